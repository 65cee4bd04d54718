"""The disk tier on a real kvstore process (gRPC + UCX + block files): a synthetic multi-turn
trace replayed through `bench multiturn --store-replay`'s driver. With a RAM too small for the
conversations, the disk arm serves later turns from disk and every fetched byte is the byte
that was put; the RAM-only arm's hit rate equals the simulation of the store's own class."""

from __future__ import annotations

import pytest

from pdserve.bench.cachesim import simulate
from pdserve.bench.storereplay import store_replay
from pdserve.workload.traces import MOONCAKE_BLOCK_TOKENS, TraceRecord

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")

BPB = 4096


def conversations(n_conv: int = 4, turns: int = 4, first: int = 3) -> list[TraceRecord]:
    """Round-robin turns of `n_conv` chats; turn k of chat c extends its chain by 2 blocks."""
    out = []
    for k in range(turns):
        for c in range(n_conv):
            ids = tuple(1000 * c + i for i in range(first + 2 * k))
            out.append(TraceRecord(len(out), len(ids) * MOONCAKE_BLOCK_TOKENS, 1, ids))
    return out


def test_disk_arm_hits_what_ram_alone_lost():
    recs = conversations()
    ram = 6 * BPB  # one chat's turn, not four chats
    res = store_replay(recs, [f"{ram}", f"{ram}+{64 * BPB}"], BPB)["arms"]
    ram_only, disk = res[f"{ram}"], res[f"{ram}+{64 * BPB}"]
    assert ram_only["wrong_blocks"] == disk["wrong_blocks"] == 0
    assert disk["fetch_latency"]["disk"]["n"] > 0
    # the disk arm can lose a block RAM evicts before the background write-through reaches
    # it (the simulation writes at once), so it is bounded by the unlimited case, not equal
    assert ram_only["hit_rate"] < disk["hit_rate"] <= simulate(recs, None, BPB).hit_rate
    assert ram_only["hit_rate"] == pytest.approx(simulate(recs, ram, BPB).hit_rate)
    assert disk["stats"]["demotions"] > 0 and disk["stats"]["promotions"] > 0
