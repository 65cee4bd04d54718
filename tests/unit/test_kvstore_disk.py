"""The kvstore's disk tier: write-through, demotion/eviction across tiers, verified reads
(a corrupt or truncated file is a miss), promotion, and a restart that finds the files."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import numpy as np
import pytest

from pdserve.kvstore.disk import DiskFiles
from pdserve.kvstore.metrics import KVStoreMetrics
from pdserve.kvstore.service import KVStoreService
from pdserve.kvstore.settings import KVStoreSettings
from pdserve.kvstore.store import BlockStore
from pdserve.rpc.metrics import Metrics

from .fake_transport import FakeTransport
from .test_kvstore_store import BS, chain, payload, put


def flush(store: BlockStore, files: DiskFiles) -> int:
    """Run the write-through queue synchronously (what DiskWorker does in a thread)."""
    n = 0
    while blocks := store.disk.take_writes(1 << 30):
        for blk in blocks:
            files.write(blk.disk_name, blk.meta(), store.arena.view(blk.slot))
        store.disk.finish_writes(blocks, [True] * len(blocks))
        n += len(blocks)
    for name in store.disk.take_unlinks():
        files.unlink(name)
    return n


def read(store: BlockStore, files: DiskFiles, hashes: list[bytes]) -> tuple[int, np.ndarray]:
    blocks = store.acquire("ns", hashes)
    out = np.zeros(len(blocks) * BS, np.uint8)
    good = store.gather(blocks, out, files)
    if good < len(blocks):
        store.disk.mark_bad(blocks[good])
    store.release(blocks)
    return good, out[: good * BS]


def block_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def test_blocks_evicted_from_ram_stay_on_disk_and_read_back(tmp_path: Path) -> None:
    files = DiskFiles(tmp_path)
    store = BlockStore(4 * BS, BS, disk_bytes=16 * BS)
    chains = [chain(t, 3) for t in range(4)]  # 12 blocks: 3x the RAM
    for c in chains:
        assert put(store, c) == 3
        assert flush(store, files) == 3
    s = store.snapshot()
    assert s.num_blocks == 12 and s.disk_blocks == 12 and s.evictions == 0
    assert s.demotions == 8 and s.used_bytes == 4 * BS
    for c in chains:  # every chain whole, RAM or disk, bytes exact
        good, data = read(store, files, c)
        assert good == 3
        np.testing.assert_array_equal(data, payload(c))
    store.check_integrity()
    for f in block_files(tmp_path):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600
    assert stat.S_IMODE(tmp_path.stat().st_mode) == 0o700


def test_one_lru_across_tiers_disk_full_evicts_the_oldest_leaf(tmp_path: Path) -> None:
    files = DiskFiles(tmp_path)
    store = BlockStore(3 * BS, BS, disk_bytes=6 * BS)
    a, b, c = chain(1, 3), chain(2, 3), chain(3, 3)
    put(store, a), flush(store, files), put(store, b), flush(store, files)
    store.lookup("ns", a)  # a is now more recent than b
    put(store, c), flush(store, files)  # needs 3 disk blocks: b's leaves go, tail first
    assert store.contains("ns", a) == 3 and store.contains("ns", c) == 3
    assert store.contains("ns", b) == 0
    assert len(block_files(tmp_path)) == 6
    assert store.snapshot().evictions == 3
    store.check_integrity()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "header"])
def test_a_corrupt_disk_block_is_a_miss(tmp_path: Path, damage: str) -> None:
    files = DiskFiles(tmp_path)
    store = BlockStore(4 * BS, BS, disk_bytes=16 * BS)
    a = chain(1, 4)
    put(store, a), flush(store, files)
    put(store, chain(2, 4)), flush(store, files)  # a is on disk only now
    victim = store.index.blocks[("ns", a[1])]
    assert victim.slot is None
    path = files.path(victim.disk_name)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[-7] ^= 0x40
    elif damage == "truncate":
        raw = raw[:-100]
    elif damage == "header":
        raw[20] ^= 0x01
    if damage == "delete":
        path.unlink()
    else:
        path.write_bytes(bytes(raw))
    good, data = read(store, files, a)
    assert good == 1  # block 0 is good; block 1 is a miss, never wrong bytes
    np.testing.assert_array_equal(data, payload(a[:1]))
    assert store.contains("ns", a) == 1 and store.lookup("ns", a) == 1
    assert store.snapshot().disk_corrupt == 1
    flush(store, files)
    assert not path.exists()  # the bad file is deleted
    assert put(store, a) == 1  # a put revives the ghost; its intact descendants count again
    flush(store, files)
    good, data = read(store, files, a)
    assert good == 4
    np.testing.assert_array_equal(data, payload(a))
    store.check_integrity()


def test_restart_finds_the_disk_tier(tmp_path: Path) -> None:
    files = DiskFiles(tmp_path)
    store = BlockStore(3 * BS, BS, disk_bytes=16 * BS)
    chains = [chain(t, 3) for t in range(3)]
    for c in chains:
        put(store, c)
        flush(store, files)
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / "junk.1.kvb").write_bytes(b"not a block")  # unreadable: dropped
    metas, bad = DiskFiles(tmp_path).scan()
    assert len(metas) == 9 and bad == ["junk.1.kvb"]
    # a restart with the first block of chain 2 lost: its descendants are orphans
    lost = next(m for m in metas if m.hash == chains[2][0])
    metas = [m for m in metas if m is not lost]
    again = BlockStore(2 * BS, BS, disk_bytes=16 * BS)
    assert again.disk.adopt(metas) == 6
    assert len(again.disk.take_unlinks()) == 2  # the orphans' files
    for c in chains[:2]:
        good, data = read(again, files, c)
        assert good == 3
        np.testing.assert_array_equal(data, payload(c))
    assert again.contains("ns", chains[2]) == 0
    again.check_integrity()
    smaller = BlockStore(2 * BS, BS, disk_bytes=4 * BS)  # restart with a smaller budget
    assert smaller.disk.adopt(DiskFiles(tmp_path).scan()[0]) == 4
    smaller.check_integrity()


async def _fetch(service: KVStoreService, hashes: list[bytes]) -> tuple[int, np.ndarray]:
    t = service.transport
    tag = t.new_tag_base()
    out = np.zeros(len(hashes) * BS, np.uint8)
    t.post_recv(out, tag)
    r = await service.fetch("ns", hashes, b"peer", tag)
    return r.num_blocks, out[: r.num_blocks * BS]


async def _put(service: KVStoreService, hashes: list[bytes]) -> int:
    from pdserve.kvstore.store import checksum

    ticket = service.begin_put("ns", hashes, 0, BS)
    data = payload(hashes[ticket.first_block : ticket.first_block + ticket.num_accepted])
    sums = [checksum(data[i * BS : (i + 1) * BS]) for i in range(ticket.num_accepted)]
    await service.transport.send(b"", ticket.tag, data)
    return await service.commit_put(ticket.put_id, sums)


def _service(tmp_path: Path) -> KVStoreService:
    settings = KVStoreSettings(
        capacity_bytes=4 * BS, block_bytes=BS, min_block_bytes=BS, disk_dir=str(tmp_path),
        disk_bytes=64 * BS,
    )  # fmt: skip
    return KVStoreService(settings, FakeTransport(), KVStoreMetrics(Metrics()))


async def test_service_fetches_from_disk_promotes_and_survives_a_restart(tmp_path: Path) -> None:
    service = _service(tmp_path)
    await service.start()
    chains = [chain(t, 4) for t in range(4)]
    try:
        for c in chains:
            assert await _put(service, c) == 4
            while await service.disk.run_once():
                pass
        n, data = await _fetch(service, chains[0])  # on disk only by now
        assert n == 4
        np.testing.assert_array_equal(data, payload(chains[0]))
        s = service.stats()
        assert s.promotions == 4 and s.disk_blocks == 16
        assert service.metrics.fetch_tier_seconds.labels("disk")._sum.get() > 0
        victim = service.store.index.blocks[("ns", chains[1][2])]
        path = service.disk.files.path(victim.disk_name)
        path.write_bytes(path.read_bytes()[:-1])
        n, data = await _fetch(service, chains[1])
        assert n == 2
        np.testing.assert_array_equal(data, payload(chains[1][:2]))
        service.store.check_integrity()
    finally:
        await service.close()
    restarted = _service(tmp_path)
    await restarted.start()
    try:
        assert restarted.stats().num_blocks == 14  # 16 - the corrupt block and its child
        n, data = await _fetch(restarted, chains[3])
        assert n == 4
        np.testing.assert_array_equal(data, payload(chains[3]))
        restarted.store.check_integrity()
    finally:
        await restarted.close()
    assert all(os.access(p, os.R_OK) for p in block_files(tmp_path))


async def test_service_clear_deletes_the_block_files(tmp_path: Path) -> None:
    service = _service(tmp_path)
    await service.start()
    try:
        assert await _put(service, chain(7, 3)) == 3
        while await service.disk.run_once():
            pass
        assert len(block_files(tmp_path)) == 3
        assert service.clear("") == 3
        while await service.disk.run_once():
            pass
        assert block_files(tmp_path) == [] and service.stats().disk_used_bytes == 0
    finally:
        await service.close()
