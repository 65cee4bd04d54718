"""KV reuse through the kvstore, end to end: a 6-turn chat on real processes gives the same
tokens with the store, without it and in the in-process engine, and from turn 2 on reuses
(nearly) the whole previous turn — fetched from the store, since with two prefill workers under
round_robin each turn lands on the worker that did not see the previous one."""

from __future__ import annotations

import pytest

from tests.integration.kvreuse_helpers import (
    Conversation,
    StoreProbe,
    full_blocks_tokens,
    make_engine,
    make_model,
    reference,
    reuse_floor,
    start_cluster,
    wait_written_back,
)

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")

TURNS = 6
SEED = 11


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kvreuse-chat"))


def run_chat(cluster, namespace: str | None) -> Conversation:
    """One conversation; with a store, each turn waits until its write-back landed."""
    from pdserve.client import Client

    conv = Conversation(SEED)
    probe = StoreProbe(cluster.kvstore_port) if namespace else None
    with Client(cluster.addr, max_retries=0) as client:
        for _ in range(TURNS):
            conv.send(client)
            if probe is not None:
                wait_written_back(probe, namespace, conv.last)
    return conv


def test_six_turn_chat_store_vs_no_store_vs_engine(model_dir):
    engine = make_engine(model_dir)

    cluster = start_cluster(model_dir, prefill=2, decode=1, kvstore=True, policy="round_robin")
    try:
        with_store = run_chat(cluster, engine.kv_fingerprint)
        stats = StoreProbe(cluster.kvstore_port).stats()
    finally:
        cluster.stop()
    cluster = start_cluster(model_dir, prefill=1, decode=1, kvstore=False)
    try:
        plain = run_chat(cluster, None)
    finally:
        cluster.stop()

    # Same tokens, turn by turn, in all three.
    for i, (a, b) in enumerate(zip(with_store.turns, plain.turns, strict=True)):
        assert a.prompt == b.prompt, f"turn {i + 1}: the conversations diverged"
        assert a.answer == b.answer, f"turn {i + 1}: store vs no store"
        assert a.answer == reference(engine, a.prompt, with_store.answer_tokens), (
            f"turn {i + 1}: cluster vs in-process engine"
        )

    turns = with_store.turns
    assert turns[0].cached_tokens == 0 and turns[0].kvstore_tokens == 0
    for i in range(1, TURNS):
        prev, turn = turns[i - 1], turns[i]
        floor = reuse_floor(len(prev.prompt), len(prev.answer))
        assert turn.cached_tokens >= floor, (
            f"turn {i + 1}: cached {turn.cached_tokens} < {floor} "
            f"(previous prompt {len(prev.prompt)} + answer {len(prev.answer)})"
        )
        # round_robin over 2 prefill workers: this worker never saw the previous turn, at most
        # the one before it (its prompt only), so the rest of the hit came from the store.
        assert turn.prefill_instance != prev.prefill_instance
        local_at_most = full_blocks_tokens(len(turns[i - 2].prompt)) if i >= 2 else 0
        assert turn.kvstore_tokens > 0
        assert turn.kvstore_tokens >= floor - local_at_most, f"turn {i + 1}"
    assert stats.hits > 0 and stats.num_blocks > 0 and stats.evictions == 0

    # Without a store nothing is fetched and the previous answers are never reused.
    assert all(t.kvstore_tokens == 0 for t in plain.turns)
    assert sum(t.cached_tokens for t in turns) > sum(t.cached_tokens for t in plain.turns)
