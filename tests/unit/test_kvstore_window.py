"""The kvstore's window parts (layered models, kvstore/window.py): a hit needs main blocks
[0, k) and window parts [k - wb, k); window parts are unchained leaves, LRU-evicted, dropped
with their main block; accounting, integrity, the disk tier and the service's fetch hold."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.kvstore.disk import DiskFiles
from pdserve.kvstore.metrics import KVStoreMetrics
from pdserve.kvstore.service import KVStoreService
from pdserve.kvstore.settings import KVStoreSettings
from pdserve.kvstore.store import BlockStore, checksum
from pdserve.kvstore.window import window_namespace
from pdserve.rpc.metrics import Metrics

from .fake_transport import FakeTransport
from .test_kvstore_disk import flush
from .test_kvstore_store import BS, chain, payload, put

WB = 3  # window parts a hit needs
PART = 2 * BS  # a window part's bytes (the main part is BS)


def put_parts(store: BlockStore, hashes: list[bytes], first: int, nbytes: int = PART) -> int:
    """The window parts of hashes[first:] (the client sends from the first one wanted)."""
    res = store.begin_put("ns", hashes, first, nbytes, window=True)
    if res is None or not res.slots:
        return 0
    data = payload(res.hashes, nbytes)[::-1].copy()  # other bytes than the main parts
    sums = [checksum(data[i * nbytes : (i + 1) * nbytes]) for i in range(len(res.hashes))]
    assert store.write_put(res, data, sums)
    n = store.commit_put(res.put_id, sums)
    store.check_integrity()
    return n


def parts_of(store: BlockStore, hashes: list[bytes]) -> list[bool]:
    wns = window_namespace("ns")
    return [(wns, h) in store.index.blocks for h in hashes]


def test_a_hit_needs_the_window_parts_before_it() -> None:
    store = BlockStore(capacity_bytes=64 * BS, extent_bytes=8 * BS)
    a = chain(1, 10)
    assert put(store, a) == 10
    assert store.windows.lookup("ns", a, WB) == (0, 10)  # main parts only: no hit
    assert put_parts(store, a, 10 - WB) == WB
    assert store.windows.lookup("ns", a, WB) == (10, 10)
    assert store.windows.lookup("ns", [*a, *chain(2, 2)], WB) == (10, 10)  # a longer prompt
    # a prompt diverging before the window parts: main hit 9, but parts [6, 9) missing
    assert store.windows.lookup("ns", [*a[:9], *chain(3, 1)], WB) == (0, 9)
    assert store.lookup("ns", a) == 10  # the main chain itself is unchanged
    # a short chain: a hit at k < wb needs the parts of [0, k)
    b = chain(4, 2)
    assert put(store, b) == 2 and put_parts(store, b, 0) == 2
    assert store.windows.lookup("ns", b, WB) == (2, 2)
    # parts without their main blocks serve nothing
    c = chain(5, 6)
    assert put(store, c[:3]) == 3 and put_parts(store, c, 3) == 3
    assert store.windows.lookup("ns", c, WB) == (0, 3)
    s = store.snapshot()
    assert s.used_bytes == (10 + 2 + 3) * BS + (WB + 2 + 3) * PART
    store.check_integrity()


def test_the_largest_hit_whose_window_is_whole() -> None:
    """Turn 1 publishes [0, 6) with parts [3, 6); turn 2 extends it to [0, 10) with parts
    [7, 10): both ends are hit points, and a part lost in the middle shortens the hit."""
    store = BlockStore(capacity_bytes=64 * BS, extent_bytes=8 * BS)
    a = chain(1, 10)
    assert put(store, a[:6]) == 6 and put_parts(store, a[:6], 6 - WB) == WB
    assert put(store, a) == 4 and put_parts(store, a, 10 - WB) == WB
    assert parts_of(store, a) == [False] * 3 + [True] * 3 + [False] + [True] * 3
    assert store.windows.lookup("ns", a, WB) == (10, 10)
    assert store.windows.lookup("ns", [*a[:8], *chain(9, 1)], WB) == (6, 8)  # turn 1's end
    assert put_parts(store, a, 10 - WB) == 0  # all there: nothing wanted
    store.index.remove(store.index.blocks[(window_namespace("ns"), a[8])])
    assert store.windows.lookup("ns", a, WB) == (6, 10)
    assert put_parts(store, a, 7) == 1  # only the missing part is stored again
    assert store.windows.lookup("ns", a, WB) == (10, 10)
    store.check_integrity()


def test_acquire_window_references_the_hit_and_release_frees_it() -> None:
    store = BlockStore(capacity_bytes=64 * BS, extent_bytes=8 * BS)
    a = chain(1, 5)
    assert put(store, a) == 5 and put_parts(store, a, 5 - WB) == WB
    main, parts = store.windows.acquire("ns", a, WB)
    assert (len(main), len(parts)) == (5, WB)
    assert all(b.refs == 1 for b in main + parts)
    out = np.empty(5 * BS + WB * PART, np.uint8)
    assert store.gather(main + parts, out) == 5 + WB
    np.testing.assert_array_equal(out[: 5 * BS], payload(a))
    np.testing.assert_array_equal(out[5 * BS :], payload(a[2:], PART)[::-1])
    store.release(main + parts)
    assert all(b.refs == 0 for b in main + parts)
    store.check_integrity()


def test_window_parts_are_leaves_evicted_by_lru_and_with_their_main_block() -> None:
    # one block size so the LRU order alone decides (a fixed-size arena of 10 slots)
    store = BlockStore(capacity_bytes=10 * BS, block_bytes=BS)
    a = chain(1, 4)
    assert put(store, a) == 4 and put_parts(store, a, 1, BS) == 3  # 7 slots
    wns = window_namespace("ns")
    for h in a[1:]:
        part = store.index.blocks[(wns, h)]
        assert part.parent is None and part.depth == 0 and part.children == 0
    assert put(store, chain(2, 3)) == 3  # fills the store: nothing evicted yet
    assert store.windows.lookup("ns", a, WB) == (4, 4)  # touches a's hit (main, then parts)
    assert put(store, chain(3, 2)) == 2  # evicts chain 2 (least recently used leaves)
    assert store.contains("ns", a) == 4 and parts_of(store, a) == [False, True, True, True]
    assert store.contains("ns", chain(2, 3)) == 1
    # evicting a main leaf drops its window part too (it can serve no hit without it)
    store.admin.pin("ns", a[:3])  # a's leaf a[3] is evictable, its ancestors are not
    assert store.snapshot().num_blocks == 10
    assert put(store, chain(4, 2)) == 2  # evicts chain 2's last block, then a[3]
    assert store.contains("ns", a) == 3 and parts_of(store, a) == [False, True, True, False]
    assert store.windows.lookup("ns", a, WB) == (0, 3)  # parts [0, 3) are not all there
    assert store.snapshot().num_blocks == 10 - 3 + 2  # a[3]'s part went with it
    store.admin.pin("ns", a[:3], -1)
    store.check_integrity()


def test_clear_and_purge_take_the_window_parts() -> None:
    store = BlockStore(capacity_bytes=64 * BS, extent_bytes=8 * BS)
    a, b = chain(1, 4), chain(2, 4)
    assert put(store, a) == 4 and put_parts(store, a, 1) == 3
    res = store.begin_put("ns", b, 0, BS, writer="bad")
    data = payload(res.hashes)
    sums = [checksum(data[i * BS : (i + 1) * BS]) for i in range(4)]
    assert store.write_put(res, data, sums) and store.commit_put(res.put_id, sums) == 4
    assert put_parts(store, b, 2) == 2  # an anonymous writer's parts of the bad chain
    assert store.admin.purge_writer("bad") == (6, 0)  # 4 main blocks + the 2 parts with them
    assert store.admin.clear("ns") == 7
    assert store.snapshot().num_blocks == 0 and store.snapshot().used_bytes == 0
    store.check_integrity()


def test_window_puts_are_validated_and_rejected_without_room() -> None:
    fixed = BlockStore(capacity_bytes=16 * BS, block_bytes=BS)
    a = chain(1, 4)
    assert put(fixed, a) == 4
    res = fixed.begin_put("ns", a, 0, PART, window=True)  # a second size: not in this store
    assert res is not None and not res.slots and fixed.stats.put_rejected == 1
    full = BlockStore(capacity_bytes=4 * BS, block_bytes=BS)
    assert put(full, a) == 4
    full.admin.pin("ns", a)
    res = full.begin_put("ns", a, 1, BS, window=True)
    assert res is not None and not res.slots  # no room: nothing reserved, nothing leaked
    full.check_integrity()
    assert full.arena.used_bytes == 4 * BS


def test_window_parts_on_the_disk_tier_read_back_and_survive_a_restart(tmp_path: Path) -> None:
    files = DiskFiles(tmp_path)
    store = BlockStore(capacity_bytes=16 * BS, block_bytes=BS, disk_bytes=64 * BS)
    a = chain(1, 6)
    assert put(store, a) == 6 and put_parts(store, a, 6 - WB, BS) == WB
    assert flush(store, files) == 6 + WB
    for t in range(2, 5):  # push a out of RAM (demotions: it stays on disk)
        assert put(store, chain(t, 4)) == 4
        flush(store, files)
    main, parts = store.windows.acquire("ns", a, WB)
    assert (len(main), len(parts)) == (6, WB)
    assert any(b.slot is None for b in main + parts)  # read from disk
    out = np.empty((6 + WB) * BS, np.uint8)
    assert store.gather(main + parts, out, files) == 6 + WB
    np.testing.assert_array_equal(out[: 6 * BS], payload(a))
    np.testing.assert_array_equal(out[6 * BS :], payload(a[3:], BS)[::-1].copy())
    store.release(main + parts)
    store.check_integrity()
    again = BlockStore(capacity_bytes=16 * BS, block_bytes=BS, disk_bytes=64 * BS)
    metas, bad = DiskFiles(tmp_path).scan()
    assert not bad
    again.disk.adopt(metas)
    again.check_integrity()
    assert again.windows.lookup("ns", a, WB) == (6, 6)


def _service(**kw) -> KVStoreService:
    kw.setdefault("capacity_bytes", 32 << 20)  # extents of 2 MiB: one per part size
    settings = KVStoreSettings(min_block_bytes=BS, **kw)
    return KVStoreService(settings, FakeTransport(), KVStoreMetrics(Metrics()))


async def test_service_fetch_sends_main_then_window_parts() -> None:
    service = _service()
    store = service.store
    a = chain(1, 6)
    assert put(store, a) == 6 and put_parts(store, a, 6 - WB) == WB
    t = service.transport
    tag = t.new_tag_base()
    out = np.zeros(5 * BS + WB * PART, np.uint8)
    t.post_recv(out, tag)
    r = await service.fetch("ns", a[1:], b"peer", tag, WB)  # past a local hit of 1 block
    assert (r.num_blocks, r.bytes_per_block, r.num_window_blocks) == (5, BS, WB)
    assert r.window_bytes_per_block == PART and len(r.checksums) == 5 + WB
    np.testing.assert_array_equal(out[: 5 * BS], payload(a[1:]))
    np.testing.assert_array_equal(out[5 * BS :], payload(a[3:], PART)[::-1].copy())
    assert r.checksums[5:] == [checksum(out[5 * BS + i * PART :][:PART]) for i in range(WB)]
    assert service.stats().bytes_out == 5 * BS + WB * PART
    # without a window part at the end: a shorter hit is none here, so nothing is sent
    tag = t.new_tag_base()
    t.post_recv(out, tag)
    r = await service.fetch("ns", a[:4], b"peer", tag, WB)
    assert r.num_blocks == 0 and r.checksums == []
    assert all(b.refs == 0 for b in store.index.blocks.values())  # nothing left referenced
    store.check_integrity()


async def test_service_window_fetch_of_a_corrupt_file_is_a_miss(tmp_path: Path) -> None:
    """A layered hit needs every part it names: a bad window part file fails the whole
    fetch (no partial hit whose window would be short), and nothing stays referenced."""
    service = _service(
        capacity_bytes=8 * BS, block_bytes=BS, disk_dir=str(tmp_path), disk_bytes=64 * BS
    )
    await service.start()
    store = service.store
    try:
        a = chain(1, 4)
        assert put(store, a) == 4 and put_parts(store, a, 4 - WB, BS) == WB
        for t in range(2, 5):  # push a out of RAM onto disk
            while await service.disk.run_once():
                pass
            assert put(store, chain(t, 4)) == 4
        part = next(
            store.index.blocks[(window_namespace("ns"), h)]
            for h in a[1:]
            if store.index.blocks[(window_namespace("ns"), h)].slot is None
        )
        path = service.disk.files.path(part.disk_name)
        path.write_bytes(path.read_bytes()[:-1])
        t = service.transport
        tag = t.new_tag_base()
        t.post_recv(np.zeros(4 * BS + WB * BS, np.uint8), tag)
        r = await service.fetch("ns", a, b"peer", tag, WB)
        assert r.num_blocks == 0 and r.num_window_blocks == 0
        assert service.stats().disk_corrupt == 1
        assert all(b.refs == 0 for b in store.index.blocks.values() if not b.writing)
        assert store.windows.lookup("ns", a, WB)[0] < 4  # the lost part shortens the hit
        store.check_integrity()
    finally:
        await service.close()


@pytest.mark.parametrize("bad", ["hash", "first_block", "bytes"])
def test_window_put_bad_input_is_refused(bad: str) -> None:
    from pdserve.errors import InvalidRequestError

    store = BlockStore(capacity_bytes=16 * BS, extent_bytes=8 * BS)
    a = chain(1, 3)
    args = {"hash": ([b"x", *a[1:]], 0, BS), "first_block": (a, 4, BS), "bytes": (a, 0, 0)}[bad]
    with pytest.raises(InvalidRequestError):
        store.begin_put("ns", args[0], args[1], args[2], window=True)
    assert store.arena.used_bytes == 0 and not store.puts
