"""BlockPool: pure bookkeeping of paged KV blocks (no torch).

Invariants (checked by `check_integrity`):
- every block id in [0, num_blocks) is either referenced (ref_count > 0) or in the free
  queue (ref_count == 0), never both, never neither;
- a block registered in the prefix cache maps hash -> block and block -> hash both ways;
- the free queue is an O(1) LRU: freed blocks go to the tail, allocation evicts from the head.
  A free block that still carries a hash is a cached block: a hit revives it (ref 0 -> 1)
  and removes it from the queue; allocation that takes it drops its hash.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


@dataclass
class PrefixCacheStats:
    queries_blocks: int = 0  # full blocks looked up
    hit_blocks: int = 0
    hit_tokens: int = 0
    evicted_blocks: int = 0  # cached blocks whose hash was dropped on reuse

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queries_blocks if self.queries_blocks else 0.0


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1:
            raise ValueError("num_blocks must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        # LRU free queue: head = least recently freed = next to evict/allocate
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[bytes, int] = {}
        self._block_to_hash: dict[int, bytes] = {}
        self.stats = PrefixCacheStats()

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (includes cached blocks with ref 0)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def block_hash(self, block_id: int) -> bytes | None:
        return self._block_to_hash.get(block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._hash_to_block.get(block_hash) if self.enable_prefix_caching else None

    def find_prefix(self, hashes: Sequence[bytes], record: bool = True) -> list[int]:
        """Longest run of cached blocks matching `hashes` from the start. Does not take refs."""
        hits: list[int] = []
        for h in hashes:
            b = self.lookup(h)
            if b is None:
                break
            hits.append(b)
        if record:
            self.record_lookup(len(hashes), len(hits))
        return hits

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        self.stats.queries_blocks += num_queried
        self.stats.hit_blocks += num_hit
        self.stats.hit_tokens += num_hit * self.block_size

    # ---- mutations -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks from the LRU head (ref 1 each). Cached ones lose their hash."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b, _ = self._free.popitem(last=False)
            self._drop_hash(b)
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on each block (prefix hit); revives cached free blocks."""
        for b in block_ids:
            if self.ref_counts[b] == 0:
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference per block. Pass a request's blocks in order: they are released
        tail-first, so a sequence's last blocks are evicted before its shared prefix."""
        for b in reversed(block_ids):
            rc = self.ref_counts[b]
            if rc <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_counts[b] = rc - 1
            if rc == 1:
                self._free[b] = None
                if b not in self._block_to_hash:
                    # holds nothing reusable: hand it out before any cached block
                    self._free.move_to_end(b, last=False)

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash. Returns False when another block
        already holds that hash (this one stays unregistered) or caching is off."""
        if not self.enable_prefix_caching:
            return False
        if self.ref_counts[block_id] <= 0:
            raise RuntimeError(f"cache_block on unreferenced block {block_id}")
        old = self._block_to_hash.get(block_id)
        if old is not None:
            return old == block_hash
        if block_hash in self._hash_to_block:
            return False
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        return True

    def _drop_hash(self, block_id: int) -> None:
        h = self._block_to_hash.pop(block_id, None)
        if h is not None:
            del self._hash_to_block[h]
            self.stats.evicted_blocks += 1

    # ---- checks --------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Raise AssertionError if any invariant above is broken."""
        for b, rc in enumerate(self.ref_counts):
            assert rc >= 0, f"block {b} has negative ref count {rc}"
            in_free = b in self._free
            assert (rc == 0) == in_free, f"block {b}: ref {rc}, in free queue: {in_free}"
        assert len(self._free) <= self.num_blocks
        assert len(self._hash_to_block) == len(self._block_to_hash)
        for h, b in self._hash_to_block.items():
            assert self._block_to_hash.get(b) == h, f"hash map inconsistent for block {b}"
