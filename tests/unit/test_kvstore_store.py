"""BlockStore / Arena bookkeeping: no network, no UCX."""

from __future__ import annotations

import random

import numpy as np
import pytest

from pdserve.errors import InvalidRequestError
from pdserve.kv.hashing import block_hashes
from pdserve.kvstore.store import BlockStore, checksum

BS = 1024  # bytes per block in these tests


def chain(tag: int, n: int, ns: str = "ns") -> list[bytes]:
    return block_hashes([tag * 1000 + i for i in range(n * 4)], 4, ns)


def payload(hashes: list[bytes], nbytes: int = BS) -> np.ndarray:
    """Deterministic per-hash block bytes, back to back."""
    out = [np.frombuffer((h * (nbytes // 16 + 1))[:nbytes], np.uint8) for h in hashes]
    return np.concatenate(out) if out else np.empty(0, np.uint8)


def put(store: BlockStore, hashes: list[bytes], ns: str = "ns", nbytes: int = BS) -> int:
    """Client-side put from block 0: returns how many blocks were stored."""
    res = store.begin_put(ns, hashes, 0, nbytes)
    if res is None or not res.slots:
        return 0
    data = payload(res.hashes, nbytes)
    sums = [checksum(data[i * nbytes : (i + 1) * nbytes]) for i in range(len(res.hashes))]
    assert store.write_put(res, data, sums)
    n = store.commit_put(res.put_id, sums)
    store.check_integrity()
    return n


def test_put_lookup_gather_roundtrip() -> None:
    store = BlockStore(capacity_bytes=16 * BS, block_bytes=BS)
    a = chain(1, 3)
    assert put(store, a) == 3
    assert store.lookup("ns", a) == 3
    assert store.lookup("ns", [*a, *chain(2, 1)]) == 3
    blocks = store.acquire("ns", a)
    out = np.empty(3 * BS, np.uint8)
    store.gather(blocks, out)
    store.release(blocks)
    np.testing.assert_array_equal(out, payload(a))
    assert [b.checksum for b in blocks] == [checksum(payload([h])) for h in a]
    assert put(store, a) == 0  # everything present: nothing to send
    s = store.snapshot()
    assert (s.hits, s.misses, s.num_blocks, s.used_bytes) == (6, 1, 3, 3 * BS)


def test_eviction_takes_lru_leaf_from_the_tail() -> None:
    store = BlockStore(capacity_bytes=4 * BS, block_bytes=BS)
    a, b, c, d, e = chain(1, 3), chain(2, 1), chain(3, 1), chain(4, 1), chain(5, 1)
    assert put(store, a) == 3 and put(store, b) == 1
    store.lookup("ns", a)  # a is now more recent than b
    assert put(store, c) == 1  # evicts b: the LRU leaf
    assert store.contains("ns", b) == 0 and store.contains("ns", a) == 3
    assert put(store, d) == 1  # a2 (touched before c was put) is the LRU leaf now
    assert store.contains("ns", a) == 2  # the tail went, the prefix stays
    assert put(store, e) == 1  # a1 became a leaf; it is older than c
    assert store.contains("ns", a) == 1 and store.contains("ns", c) == 1
    store.lookup("ns", a)
    assert put(store, chain(6, 1)) == 1  # a0 is fresh now: c goes
    assert store.contains("ns", c) == 0 and store.contains("ns", a) == 1
    assert store.snapshot().evictions == 4


def test_pins_protect_blocks_and_ancestors() -> None:
    store = BlockStore(capacity_bytes=4 * BS, block_bytes=BS)
    a, x = chain(1, 3), chain(2, 2)
    put(store, a)
    assert store.admin.pin("ns", a[:2]) == 2
    assert put(store, x) == 2  # one free slot + a2 (the only unpinned leaf)
    assert store.contains("ns", a) == 2
    assert store.admin.pin("ns", x) == 2
    res = store.begin_put("ns", chain(3, 1), 0, BS)  # all pinned: no room
    assert res is not None and not res.slots
    s = store.snapshot()
    assert s.put_rejected == 1 and s.pinned_blocks == 4
    assert store.admin.pin("ns", a, delta=-1) == 2
    assert put(store, chain(3, 1)) == 1  # a1: the unpinned leaf
    assert store.contains("ns", a) == 1 and store.contains("ns", x) == 2
    store.check_integrity()


def test_capacity_never_exceeded_under_random_load() -> None:
    rng = random.Random(0)
    store = BlockStore(capacity_bytes=20 * BS, block_bytes=BS)
    chains = [chain(i, rng.randint(1, 8)) for i in range(30)]
    for _ in range(300):
        c = rng.choice(chains)
        op = rng.random()
        if op < 0.5:
            put(store, c[: rng.randint(1, len(c))])
        elif op < 0.8:
            store.lookup("ns", c)
        elif op < 0.9:
            store.admin.pin("ns", c[:1], delta=rng.choice((1, -1)))
        else:
            blocks = store.acquire("ns", c)
            store.release(blocks)
        s = store.snapshot()
        assert s.used_bytes <= s.capacity_bytes == 20 * BS
        store.check_integrity()
    assert store.snapshot().evictions > 0


def test_namespaces_are_isolated() -> None:
    store = BlockStore(capacity_bytes=8 * BS, block_bytes=BS)
    h = chain(1, 2, ns="x")
    put(store, h, ns="x")
    assert store.lookup("y", h) == 0
    put(store, h, ns="y")  # same hashes, other namespace: stored separately
    assert store.snapshot().num_blocks == 4
    assert store.admin.clear("x") == 2
    assert store.lookup("x", h) == 0 and store.lookup("y", h) == 2


def test_corrupt_put_is_dropped_and_slots_freed() -> None:
    store = BlockStore(capacity_bytes=8 * BS, block_bytes=BS)
    a = chain(1, 3)
    res = store.begin_put("ns", a, 0, BS)
    assert res is not None and store.snapshot().used_bytes == 3 * BS
    data = payload(a)
    sums = [checksum(data[i * BS : (i + 1) * BS]) for i in range(3)]
    data[BS + 5] ^= 0xFF  # one flipped byte in block 1
    assert not store.write_put(res, data, sums)
    assert not store.write_put(res, data[: 2 * BS], sums)  # short
    store.abort_put(res.put_id, corrupt=True)
    s = store.snapshot()
    assert (s.used_bytes, s.num_blocks, s.corrupt_puts) == (0, 0, 1)
    assert store.lookup("ns", a) == 0
    store.check_integrity()


def test_parent_must_be_stored() -> None:
    store = BlockStore(capacity_bytes=8 * BS, block_bytes=BS)
    a = chain(1, 4)
    put(store, a[:1])
    res = store.begin_put("ns", a, 2, BS)  # client sends from block 2, block 1 is missing
    assert res is not None and not res.slots and store.snapshot().put_rejected == 1
    res = store.begin_put("ns", a, 1, BS)
    assert res is not None and res.first_block == 1 and len(res.slots) == 3
    store.abort_put(res.put_id)
    with pytest.raises(InvalidRequestError):
        store.begin_put("ns", [b"short"], 0, BS)


def test_parent_of_open_put_is_not_evicted() -> None:
    store = BlockStore(capacity_bytes=3 * BS, block_bytes=BS)
    a = chain(1, 3)
    put(store, a[:1])
    res = store.begin_put("ns", a, 0, BS)  # reserves 2 slots, references a0
    assert res is not None and len(res.slots) == 2
    assert put(store, chain(2, 1)) == 0  # full: a0 is referenced, nothing evictable
    data = payload(res.hashes)
    sums = [checksum(data[i * BS : (i + 1) * BS]) for i in range(2)]
    assert store.write_put(res, data, sums)
    assert store.commit_put(res.put_id, sums) == 2
    assert store.lookup("ns", a) == 3
    store.check_integrity()


def test_two_block_sizes_share_the_budget() -> None:
    store = BlockStore(capacity_bytes=8 * BS, extent_bytes=2 * BS)  # 4 extents
    small = chain(1, 8, ns="s")
    assert put(store, small, ns="s", nbytes=BS) == 8
    big = chain(2, 2, ns="b")
    assert put(store, big, ns="b", nbytes=2 * BS) == 2  # evicted small leaves for 2 extents
    assert store.lookup("s", small) == 4 and store.lookup("b", big) == 2
    assert store.snapshot().used_bytes <= 8 * BS
    store.check_integrity()
