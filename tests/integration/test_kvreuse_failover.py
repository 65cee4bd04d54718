"""The kvstore is a cache, never a dependency, end to end on a 1P1D cluster:
- a restarted (cold) prefill worker gets the conversation's prefix from the store;
- with the store killed (SIGKILL) requests keep succeeding by recompute, same tokens, no client
  retries (the workers' store calls fail fast and back off);
- a new store on the same port is picked up again: hits resume on a fresh prefill worker."""

from __future__ import annotations

import time

import pytest

from tests.integration.kvreuse_helpers import (
    Conversation,
    StoreProbe,
    make_engine,
    make_model,
    reference,
    reuse_floor,
    start_cluster,
    wait_written_back,
)

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")

REQUEST_TIMEOUT_S = 60.0  # a hang guard per request, not a latency claim
MAX_TURNS_UNTIL_LANDED = 6  # turns (each waiting <= 5 s) until the new store is used again


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kvreuse-failover"))


def test_store_restarts_and_outage(model_dir, tmp_path):
    from pdserve.client import Client

    engine = make_engine(model_dir)
    ns = engine.kv_fingerprint
    conv = Conversation(seed=7)
    cluster = start_cluster(
        model_dir, prefill=1, decode=1, kvstore=True, log_dir=str(tmp_path / "logs")
    )
    try:
        probe = StoreProbe(cluster.kvstore_port)
        store_port = cluster.kvstore_port
        with Client(cluster.addr, max_retries=0) as client:

            def send():
                return conv.send(client, timeout=REQUEST_TIMEOUT_S)

            def floor_of_previous() -> int:
                prev = conv.turns[-2]
                return reuse_floor(len(prev.prompt), len(prev.answer))

            # 1-2: warm the store.
            for _ in range(2):
                send()
                wait_written_back(probe, ns, conv.last)

            # 3: a cold prefill worker gets the whole previous turn from the store.
            cluster.restart("prefill0")
            turn = send()
            assert turn.kvstore_tokens >= floor_of_previous() > 0
            assert turn.cached_tokens >= floor_of_previous()
            wait_written_back(probe, ns, conv.last)

            # 4-5: the store is gone; requests still succeed (recompute), the second one on a
            # cold prefill worker with nothing cached anywhere.
            cluster.kill("kvstore")
            outage = []
            for restart_prefill in (False, True):
                if restart_prefill:
                    cluster.restart("prefill0")
                started = time.monotonic()
                turn = send()
                outage.append(time.monotonic() - started)
                assert turn.kvstore_tokens == 0
            assert turn.cached_tokens == 0, "a cold worker without a store recomputes all"

            # 6: a new (empty) store on the same port; the workers use it again once their
            # store clients' backoff ran out (a turn sent meanwhile is not published: the
            # store is a cache), so keep chatting until a turn's write-back lands (bounded).
            cluster.restart("kvstore")
            assert cluster.kvstore_port == store_port
            turns_until_landed = 0
            while True:
                assert turns_until_landed < MAX_TURNS_UNTIL_LANDED, "the new store stays unused"
                send()
                turns_until_landed += 1
                try:
                    wait_written_back(probe, ns, conv.last, timeout=5.0)
                    break
                except AssertionError:
                    continue

            # 7: hits resume on a fresh prefill worker.
            cluster.restart("prefill0")
            turn = send()
            assert turn.kvstore_tokens >= floor_of_previous() > 0
            assert turn.cached_tokens >= floor_of_previous()
    finally:
        cluster.stop()

    print(  # information only (pytest -s): no timing assertions
        f"requests without a store took {', '.join(f'{s:.2f} s' for s in outage)}; "
        f"the new store held a write-back from turn {turns_until_landed} after its start"
    )
    for i, turn in enumerate(conv.turns):
        want = reference(engine, turn.prompt, conv.answer_tokens)
        assert turn.answer == want, f"turn {i + 1}"
