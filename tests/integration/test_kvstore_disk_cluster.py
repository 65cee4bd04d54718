"""The kvstore's disk tier in a whole cluster started the way `pdserve up --kvstore-disk-dir`
starts it: a store whose RAM holds about one conversation, 4 interleaved 3-turn chats. Blocks
that RAM evicts are kept on disk (files mode 0600) and later turns are served from there, with
every output token exact."""

from __future__ import annotations

import stat

import pytest

from tests.integration.kvreuse_helpers import (
    Conversation,
    StoreProbe,
    make_engine,
    make_model,
    reference,
    start_cluster,
    wait_until,
)

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")

SESSIONS = 4
TURNS = 3


def test_up_with_a_disk_tier_serves_evicted_turns_from_disk(tmp_path_factory):
    from pdserve.client import Client

    model_dir = make_model(tmp_path_factory.mktemp("disk-cluster"))
    disk_dir = tmp_path_factory.mktemp("kvstore-disk")
    engine = make_engine(model_dir)
    bpb = engine.spec.bytes_per_block
    convs = [Conversation(seed=200 + s) for s in range(SESSIONS)]
    final_len = (
        convs[0].first_tokens + (TURNS - 1) * convs[0].user_tokens + TURNS * convs[0].answer_tokens
    )
    ram = (final_len // 16) * bpb  # about one conversation
    cluster = start_cluster(
        model_dir, prefill=1, decode=1, kvstore=True, kvstore_capacity_bytes=ram,
        kvstore_disk_dir=str(disk_dir), kvstore_disk_bytes=64 * ram,
    )  # fmt: skip
    try:
        argv = cluster.processes["kvstore"].argv
        assert argv[argv.index("--disk-dir") + 1] == str(disk_dir)
        probe = StoreProbe(cluster)
        with Client(cluster.addr, max_retries=0) as client:
            for _ in range(TURNS):  # round r of every session, one after another
                for conv in convs:
                    conv.send(client, session_id=f"s{conv.seed}")
        wait_until(lambda: probe.stats().open_puts == 0, 30.0, "store idle")
        stats = probe.stats()
    finally:
        cluster.stop()

    for conv in convs:
        for i, turn in enumerate(conv.turns):
            assert turn.answer == reference(engine, turn.prompt, conv.answer_tokens), (
                f"session {conv.seed} turn {i + 1}"
            )
    assert stats.disk_capacity_bytes == 64 * ram
    assert stats.demotions > 0, "RAM of one chat never pushed a block to disk for four"
    assert stats.disk_hits > 0 and stats.disk_corrupt == 0, "no hit was served from disk"
    files = [p for p in disk_dir.rglob("*") if p.is_file()]
    assert files, "the disk tier wrote no block file"
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in files)
    # later turns reused earlier turns' KV although RAM could not hold them
    assert sum(t.cached_tokens for c in convs for t in c.turns[1:]) > 0
