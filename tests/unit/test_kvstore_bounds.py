"""The kvstore's memory stays bounded under well-formed but hostile puts (the fuzz that grew
it from 159 MB to 2.8 GB): a tiny declared block size used to build a free list of
extent_bytes / slot_bytes indices per extent; puts begun and never committed are capped,
expire, and show in Stats."""

from __future__ import annotations

import asyncio
import tracemalloc

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.kv.hashing import block_hashes
from pdserve.kvstore.arena import Arena
from pdserve.kvstore.metrics import KVStoreMetrics
from pdserve.kvstore.service import KVStoreService
from pdserve.kvstore.settings import KVStoreSettings
from pdserve.rpc.metrics import Metrics

from .fake_transport import FakeTransport


def test_tiny_slots_cost_memory_per_slot_used_not_per_slot_possible() -> None:
    arena = Arena(capacity_bytes=64 << 20, extent_bytes=64 << 20)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        slots = [arena.alloc(1) for _ in range(10)]  # 64 Mi possible 1-byte slots
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(s is not None for s in slots)
    assert grown < 1 << 20, f"{grown} B of bookkeeping for 10 slots"
    for s in slots:
        arena.free(s)
    assert arena.used_bytes == 0
    # freed slots are reused; an emptied extent goes back to another size
    assert arena.alloc(1) is not None and arena.alloc(2) is None
    assert arena.reclaim(keep=2) is False  # the 1-byte extent is in use again


def _service(**kw) -> KVStoreService:
    settings = KVStoreSettings(capacity_bytes=1 << 20, put_timeout_s=0.2, **kw)
    return KVStoreService(settings, FakeTransport(), KVStoreMetrics(Metrics()))


def _hashes(n: int, tag: int = 0) -> list[bytes]:
    return block_hashes([tag * 10_000 + i for i in range(4 * n)], 4, "ns")


async def test_open_puts_are_capped_counted_and_expire() -> None:
    service = _service(max_open_puts=3)
    await service.start()
    try:
        tickets = [service.begin_put("ns", _hashes(2, t), 0, 1024) for t in range(5)]
        assert [t.num_accepted for t in tickets] == [2, 2, 2, 0, 0]  # cap of 3 open puts
        stats = service.stats()
        assert stats.open_puts == 3 and stats.put_rejected == 2
        assert stats.staging_bytes == 3 * 2 * 1024 and stats.used_bytes == 3 * 2 * 1024
        for _ in range(100):  # never committed: the reaper drops them
            await asyncio.sleep(0.05)
            if service.stats().open_puts == 0:
                break
        stats = service.stats()
        assert (stats.open_puts, stats.staging_bytes, stats.used_bytes) == (0, 0, 0)
        service.store.check_integrity()
    finally:
        await service.close()


def test_a_put_must_declare_a_real_block_size() -> None:
    service = _service()
    with pytest.raises(InvalidRequestError) as ei:
        service.begin_put("ns", _hashes(1), 0, 1)
    assert ei.value.field == "bytes_per_block"
    assert service.stats().open_puts == 0
