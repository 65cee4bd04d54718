"""The kvstore under capacity pressure, end to end: a store with room for ~3 conversations, 8
interleaved 3-turn chats (4 in flight at a time). Outputs stay exact, the store evicts (and
counts it), its accounting stays inside the budget, and its resident memory stays within the
budget plus a stated overhead."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.integration.kvreuse_helpers import (
    Conversation,
    StoreProbe,
    make_engine,
    make_model,
    reference,
    rss_bytes,
    start_cluster,
    wait_until,
)

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")

SESSIONS = 8
TURNS = 3
CONVERSATIONS_THAT_FIT = 3
STAGING_BYTES = 1 << 20  # the store's staging budget (puts/fetches in flight), set below
# Resident memory the store may hold beyond its block budget, on top of the baseline measured
# once it is ready (Python + grpc + ucx + the untouched arena's page tables): the staging
# budget (np buffers of puts/fetches in flight, freed after) + 16 MiB of allocator/gRPC/UCX
# working memory that grows with traffic (message buffers, malloc arenas of its threads).
RSS_SLACK_BYTES = STAGING_BYTES + (16 << 20)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("kvreuse-capacity"))


def test_interleaved_sessions_under_capacity_pressure(model_dir):
    from pdserve.client import Client

    engine = make_engine(model_dir)
    bpb = engine.spec.bytes_per_block
    convs = [Conversation(seed=100 + s) for s in range(SESSIONS)]
    final_len = (
        convs[0].first_tokens + (TURNS - 1) * convs[0].user_tokens + TURNS * convs[0].answer_tokens
    )
    blocks_per_conversation = final_len // 16
    capacity = CONVERSATIONS_THAT_FIT * blocks_per_conversation * bpb

    cluster = start_cluster(
        model_dir, prefill=1, decode=1, kvstore=True, kvstore_capacity_bytes=capacity,
        env={"PDSERVE_KVSTORE_STAGING_BYTES": str(STAGING_BYTES)},
    )  # fmt: skip
    try:
        probe = StoreProbe(cluster)
        store_pid = cluster.processes["kvstore"].popen.pid
        rss_start = rss_bytes(store_pid)
        with Client(cluster.addr, max_retries=0) as client, ThreadPoolExecutor(4) as pool:
            for _ in range(TURNS):  # round r of every session, 4 at a time
                list(pool.map(lambda c: c.send(client, session_id=f"s{c.seed}"), convs))

        def settled() -> bool:  # background publishes/write-backs done: no open puts, and
            # every staging buffer returned (a fetch's is freed after its reply, on the store's
            # own time: CI once read 57,344 staging bytes right after the last turn)
            s = probe.stats()
            return s.open_puts == 0 and s.used_bytes == s.num_blocks * bpb and s.staging_bytes == 0

        wait_until(settled, 30.0, "store idle")
        stats = probe.stats()
        rss_end = rss_bytes(store_pid)
    finally:
        cluster.stop()

    for conv in convs:
        for i, turn in enumerate(conv.turns):
            want = reference(engine, turn.prompt, conv.answer_tokens)
            assert turn.answer == want, f"session {conv.seed} turn {i + 1}"

    written = SESSIONS * blocks_per_conversation  # far more than fits
    assert written > capacity // bpb
    assert stats.capacity_bytes <= capacity
    assert stats.used_bytes <= stats.capacity_bytes
    assert stats.num_blocks <= capacity // bpb
    assert stats.evictions > 0, "a store of 3 conversations' room never evicted for 8"
    assert stats.hits > 0
    assert stats.corrupt_puts == 0 and stats.staging_bytes == 0
    assert stats.bytes_in >= stats.num_blocks * bpb  # every stored block came by a commit
    assert rss_end <= rss_start + capacity + RSS_SLACK_BYTES, (
        f"kvstore RSS {rss_end / 2**20:.1f} MiB > start {rss_start / 2**20:.1f} MiB + "
        f"capacity {capacity / 2**20:.2f} MiB + slack {RSS_SLACK_BYTES / 2**20:.0f} MiB"
    )
