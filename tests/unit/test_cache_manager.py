"""KVCacheManager: every block reference has a named owner; release is idempotent; integrity
catches a reference nobody owns. Pure bookkeeping (no model)."""

from __future__ import annotations

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.engine.sequence import Sequence
from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.kv.cache_manager import KVCacheManager

BS = 4


def seq(rid: str, n: int, start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=4))


def computed(kv: KVCacheManager, s: Sequence) -> None:
    """Place `s`'s whole prompt and mark it computed (as a step would)."""
    assert kv.allocate_first_chunk(s, 1000, record=True) > 0
    s.num_computed_tokens = s.num_tokens
    kv.register_computed(s)


def test_reservation_is_owned_by_its_request_and_released_once() -> None:
    kv = KVCacheManager(8, BS, True, "t")
    blocks = kv.reserve("r", 9)  # 3 blocks
    assert len(blocks) == 3 and kv.num_free_blocks == 5
    assert (kv.num_reservations, kv.num_reserved_blocks) == (1, 3)
    with pytest.raises(InvalidRequestError):
        kv.reserve("r", 4)
    with pytest.raises(OverloadedError):
        kv.reserve("big", 100)
    kv.check_integrity([])
    assert kv.release("r") == 3 and kv.release("r") == 0
    assert kv.num_free_blocks == 8 and kv.num_reservations == 0
    kv.check_integrity([])


def test_claimed_reservation_becomes_the_sequence_table() -> None:
    kv = KVCacheManager(8, BS, True, "t")
    kv.reserve("r", 9)
    s = seq("r", 8)
    s.block_table = kv.claim_reservation("r")
    assert kv.num_reservations == 0 and kv.release("r") == 0  # nothing left to release
    kv.check_integrity([s])
    kv.free(s)
    assert kv.num_free_blocks == 8
    kv.check_integrity([])


def test_prefix_hold_until_scheduled_and_finished_hold_until_released() -> None:
    kv = KVCacheManager(8, BS, True, "t")
    a = seq("a", 13)  # 3 full blocks + 1 token
    computed(kv, a)
    kv.free(a, finished=True)  # no hold asked: all free, 3 blocks cached
    assert kv.num_free_blocks == 8 and kv.num_cached_blocks == 3
    hashes = kv.compute_block_hashes(list(range(13)))
    assert kv.hold_prefix("b", hashes) == 3 and kv.num_held_blocks == 3
    assert kv.num_free_blocks == 5  # held blocks cannot be evicted
    b = seq("b", 13)
    kv.hold_on_finish("b")
    computed(kv, b)  # placed: the hold is dropped, the sequence holds the prefix itself
    assert kv.num_held_blocks == 0
    kv.check_integrity([b])
    kv.free(b, finished=True)  # finished: its full blocks are held for the publish
    assert kv.num_held_blocks == 3 and kv.num_free_blocks == 5
    kv.check_integrity([])
    assert kv.release("b") == 3 and kv.num_free_blocks == 8
    kv.check_integrity([])


def test_integrity_catches_a_reference_without_owner() -> None:
    kv = KVCacheManager(4, BS, True, "t")
    s = seq("s", 5)
    computed(kv, s)
    with pytest.raises(AssertionError, match="owners"):
        kv.check_integrity([])  # the sequence's blocks are not accounted for
    kv.free(s)
    kv.check_integrity([])
