"""BlockIndex: the kvstore's block records, their recency and their eviction (bookkeeping only).

The one owner of the store's state: every block by key, the arena its RAM copies live in, the
LRU heaps of the RAM and disk tiers, and the counters. `BlockStore` (store.py) builds its put and
fetch paths on it; the disk tier (tiers.py) and the window parts (window.py) are objects that
hold the same index. Rules (module docstring of store.py):
- a block is evictable from RAM iff it is not pinned, not referenced, and a leaf (children == 0)
  or on disk (then only its RAM copy goes: a demotion);
- from disk iff it is an unpinned, unreferenced leaf;
- a ghost (neither copy) leaves as soon as it has no children and no refs.
Heap entries are (last_used, id, block), checked when popped (stale ones are skipped).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator, Sequence

from pdserve.kvstore.arena import Arena, Slot
from pdserve.kvstore.blocks import Block, Key
from pdserve.kvstore.stats import StoreStats

HeapEntry = tuple[int, int, Block]


class BlockIndex:
    def __init__(
        self, capacity_bytes: int, block_bytes: int, extent_bytes: int, disk_bytes: int
    ) -> None:
        """`block_bytes` > 0: only that block size, one extent = the whole arena. Otherwise
        extents of `extent_bytes` (default capacity/16, at least 1 MiB) serve any size.
        `disk_bytes` > 0: a disk tier of that many block bytes."""
        if block_bytes > 0:
            extent_bytes = (capacity_bytes // block_bytes) * block_bytes
        elif extent_bytes <= 0:
            extent_bytes = min(capacity_bytes, max(capacity_bytes // 16, 1 << 20))
        self.block_bytes = block_bytes
        self.arena = Arena(capacity_bytes, extent_bytes)
        self.stats = StoreStats(
            capacity_bytes=self.arena.capacity_bytes, disk_capacity_bytes=disk_bytes
        )
        self.disk_capacity = disk_bytes
        self.disk_used = 0  # block bytes on disk or being written
        self.blocks: dict[Key, Block] = {}
        self.lru: dict[int, list[HeapEntry]] = {}  # RAM: size -> heap
        self.disk_lru: list[HeapEntry] = []
        self.unlinks: list[str] = []  # files of removed blocks, to delete (service, thread)
        self.tick = itertools.count(1)
        # called with each block that leaves the index (the window parts follow their block)
        self.on_remove: list[Callable[[Block], None]] = []

    # ------------------------------------------------------------------ queries
    def prefix(self, namespace: str, hashes: Sequence[bytes]) -> list[Block]:
        """The stored blocks of the chain's longest stored prefix (a ghost ends it)."""
        out: list[Block] = []
        for h in hashes:
            blk = self.blocks.get((namespace, bytes(h)))
            if blk is None or blk.ghost:
                break
            out.append(blk)
        return out

    def get(self, key: Key) -> Block | None:
        return self.blocks.get(key)

    def holds(self, blk: Block) -> bool:
        """`blk` is still the stored block of its key (not removed, not replaced)."""
        return self.blocks.get(blk.key) is blk

    def __iter__(self) -> Iterator[Block]:
        return iter(self.blocks.values())

    def __len__(self) -> int:
        return len(self.blocks)

    def touch(self, blocks: Sequence[Block]) -> None:
        for blk in blocks:  # chain order: a child is always more recent than its parent
            blk.last_used = next(self.tick)
            self.maybe_evictable(blk)

    def release(self, blocks: Sequence[Block]) -> None:
        for blk in blocks:
            blk.refs -= 1
            self.maybe_evictable(blk)

    def add(self, blk: Block) -> None:
        self.blocks[blk.key] = blk
        if blk.parent is not None:
            blk.parent.children += 1

    # ------------------------------------------------------------------ eviction
    def maybe_evictable(self, blk: Block) -> None:
        """Queue `blk` in the LRU heaps it now qualifies for (entries are checked on pop)."""
        if not self.holds(blk) or blk.refs:
            return
        if blk.ghost:
            if blk.children == 0:
                self.remove(blk)
            return
        if blk.pins:
            return
        entry = (blk.last_used, id(blk), blk)
        if blk.slot is not None and (blk.children == 0 or blk.on_disk):
            heap = self.lru.setdefault(blk.nbytes, [])
            heapq.heappush(heap, entry)
            if len(heap) > 4 * len(self.blocks) + 64:
                self.lru[blk.nbytes] = self._live(lambda b: self.ram_ok(b, blk.nbytes))
        if blk.on_disk and blk.children == 0:
            heapq.heappush(self.disk_lru, entry)
            if len(self.disk_lru) > 4 * len(self.blocks) + 64:
                self.disk_lru = self._live(self.disk_ok)

    @staticmethod
    def ram_ok(b: Block, size: int) -> bool:
        """May `b`'s RAM copy go (dropped if on disk, else `b` is evicted)?"""
        return (
            b.slot is not None
            and b.nbytes == size
            and not (b.refs or b.pins)
            and (b.children == 0 or b.on_disk)
        )

    @staticmethod
    def disk_ok(b: Block) -> bool:
        return b.on_disk and not (b.children or b.refs or b.pins)

    def _live(self, ok: Callable[[Block], bool]) -> list[HeapEntry]:
        live = [(b.last_used, id(b), b) for b in self.blocks.values() if ok(b)]
        heapq.heapify(live)
        return live

    def pop(self, heap: list[HeapEntry], ok: Callable[[Block], bool]) -> Block | None:
        """The least recently used block of `heap` that still qualifies (None: none)."""
        while heap:
            stamp, _, blk = heapq.heappop(heap)
            if ok(blk) and stamp == blk.last_used and self.holds(blk):
                return blk
        return None

    def _evict_one(self, size: int) -> bool:
        """Free one RAM slot of `size`: demote an LRU block that is on disk, or evict an LRU
        leaf that is not."""
        blk = self.pop(self.lru.get(size, []), lambda b: self.ram_ok(b, size))
        if blk is None:
            return False
        if blk.on_disk:
            assert blk.slot is not None
            self.arena.free(blk.slot)
            blk.slot = None
            self.stats.demotions += 1
            self.maybe_evictable(blk)
        else:
            self.remove(blk)
            self.stats.evictions += 1
        return True

    def remove(self, blk: Block) -> None:
        """`blk` leaves the store: its RAM slot is freed and its file queued for deletion."""
        del self.blocks[blk.key]
        if blk.slot is not None:
            self.arena.free(blk.slot)
            blk.slot = None
        if blk.on_disk:
            self.disk_used -= blk.nbytes
            self.unlinks.append(blk.disk_name)
            blk.on_disk = False
        if blk.parent is not None:
            blk.parent.children -= 1
            self.maybe_evictable(blk.parent)
        for hook in self.on_remove:
            hook(blk)

    def alloc(self, size: int) -> Slot | None:
        """A RAM slot of `size`, evicting LRU blocks as needed (None: nothing can go)."""
        while True:
            slot = self.arena.alloc(size)
            if slot is not None:
                return slot
            if self._evict_one(size):
                continue
            # another block size holds the extents: evict its LRU leaves until one empties
            if self.arena.reclaim(keep=size):
                continue
            others = sorted(
                (n, s) for s, n in self.arena.extent_counts().items() if s != size and n
            )
            if not others or not self._evict_one(others[-1][1]):
                return None
