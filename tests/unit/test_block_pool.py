import pytest

from pdserve.kv.block_pool import BlockPool, NoFreeBlocksError


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_allocate_free_roundtrip_and_integrity():
    pool = BlockPool(8, 4)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert sorted(a + b) == list(range(8))
    assert pool.num_free_blocks == 0
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(1)
    pool.check_integrity()
    pool.free(a)
    pool.free(b)
    assert pool.num_free_blocks == 8
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.free([a[0]])


def test_ref_counts_and_revival_of_cached_block():
    pool = BlockPool(4, 4)
    [blk] = pool.allocate(1)
    assert pool.cache_block(blk, h(1))
    pool.touch([blk])  # a second user
    assert pool.ref_counts[blk] == 2
    pool.free([blk])
    pool.free([blk])
    assert pool.num_free_blocks == 4 and pool.ref_counts[blk] == 0
    # still cached: a lookup finds it and touch revives it
    assert pool.find_prefix([h(1), h(2)]) == [blk]
    assert pool.stats.hit_blocks == 1 and pool.stats.hit_tokens == 4
    pool.touch([blk])
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    pool.free([blk])
    pool.check_integrity()


def test_lru_evicts_least_recently_freed_cached_block_first():
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    # head of the LRU is blocks[1]
    [got] = pool.allocate(1)
    assert got == blocks[1]
    assert pool.lookup(h(1)) is None  # its hash was evicted
    assert pool.lookup(h(0)) == blocks[0] and pool.lookup(h(2)) == blocks[2]
    assert pool.stats.evicted_blocks == 1
    pool.free([got])
    pool.check_integrity()


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    pool.cache_block(a, h(7))
    pool.free([a])
    pool.free([b])  # uncached: goes to the head
    assert pool.allocate(1) == [b]
    assert pool.lookup(h(7)) == a


def test_request_blocks_freed_tail_first():
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, h(i))
    pool.free(blocks)  # tail block evicted first, shared prefix kept longest
    assert pool.allocate(1) == [blocks[2]]


def test_duplicate_hash_not_registered_twice():
    pool = BlockPool(2, 2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, h(5))
    assert not pool.cache_block(b, h(5))
    assert pool.block_hash(b) is None
    pool.free([a, b])
    pool.check_integrity()


def test_prefix_caching_disabled():
    pool = BlockPool(2, 2, enable_prefix_caching=False)
    [a] = pool.allocate(1)
    assert not pool.cache_block(a, h(1))
    assert pool.lookup(h(1)) is None
    pool.free([a])
    pool.check_integrity()


def test_check_integrity_detects_corruption():
    pool = BlockPool(2, 2)
    [a] = pool.allocate(1)
    pool.ref_counts[a] = 0  # corrupt: unreferenced but not free
    with pytest.raises(AssertionError):
        pool.check_integrity()
