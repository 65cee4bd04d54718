"""BlockStore: content-addressed KV blocks in an Arena, LRU-evicted from the tail of chains.

Pure bookkeeping + byte copies; no network, no asyncio, no torch. Everything except
`write_put` / `gather` must run on one thread (the service's event loop); those two touch only
slots that are reserved (a put) or referenced (a fetch), so they may run in a worker thread.

Invariants (checked by `check_integrity`):
- A block is keyed by (namespace, 16-byte chained hash); its parent is the previous hash of its
  chain in the same namespace, or the root. A block is stored only if its parent is stored, so
  the stored blocks of a chain always form a prefix.
- `children` = stored blocks whose parent is this block. A block is evictable iff it is a leaf
  (children == 0), not pinned and not referenced (in an open put or fetch). Eviction takes the
  least recently used evictable leaf of the needed slot size, so a chain shrinks from its tail
  and a block never goes while a longer chain through it stays; pins protect ancestors for free.
- Bytes in use (reserved + stored slots) never exceed the arena, which never exceeds capacity.

Layered models (Gemma 4's sliding layers, window.py): a block's *main* part (full-attention
layers) lives in the client's namespace under the rules above; its *window* part (sliding
layers) in a second namespace, `window_namespace(ns)`, same hashes, unchained (parent None,
depth 0: a leaf, LRU alone), published for the last blocks of a chain only. `lookup_window`
/ `acquire_window` serve the largest hit whose window parts are all stored.

Disk tier (`disk_bytes` > 0; the files are the service's, see disk.py): write-through. Every
committed block is queued for a copy on disk (`take_writes` / `finish_writes`, the service
writes in a thread), so the disk holds (nearly) a superset of RAM and one recency order
serves both tiers:
- RAM full: the least recently used RAM copy goes. If the block is on disk, only its RAM copy
  is dropped (a demotion: no I/O, any chain position); if not, it must be an evictable leaf and
  leaves the store (an eviction), as without a disk tier.
- Disk full: the least recently used evictable leaf on disk leaves the store (both copies).
- A block with neither copy (its only copy was a corrupt file) is a *ghost*: lookups stop in
  front of it, a put revives it, and it is removed as soon as it has no children or refs.
- A fetch reads disk-only blocks from their files (verified) and copies them back into RAM
  (a promotion: `reserve_promotions` / `finish_promotions`).
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Sequence

import numpy as np

from pdserve.errors import InvalidRequestError
from pdserve.kvstore.admin import AdminMixin
from pdserve.kvstore.arena import Arena, Slot
from pdserve.kvstore.blocks import HASH_BYTES, Block, Key, PutReservation, checksum
from pdserve.kvstore.disk import DiskFiles
from pdserve.kvstore.stats import StoreStats
from pdserve.kvstore.tiers import TierMixin
from pdserve.kvstore.window import WindowMixin

__all__ = ["HASH_BYTES", "Block", "BlockStore", "PutReservation", "checksum"]


class BlockStore(TierMixin, AdminMixin, WindowMixin):
    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int = 0,
        extent_bytes: int = 0,
        disk_bytes: int = 0,
    ) -> None:
        """`block_bytes` > 0: only that block size, one extent = the whole arena. Otherwise
        extents of `extent_bytes` (default capacity/16, at least 1 MiB) serve any size.
        `disk_bytes` > 0: a disk tier of that many block bytes (module docstring)."""
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
        self._blocks: dict[Key, Block] = {}
        self._lru: dict[int, list[tuple[int, int, Block]]] = {}  # RAM: size -> heap
        self._disk_lru: list[tuple[int, int, Block]] = []
        self._unwritten: deque[Block] = deque()  # committed, not yet scheduled for disk
        self._unlinks: list[str] = []  # files of removed blocks, to delete (service, thread)
        self._generation = itertools.count(1)
        self._tick = itertools.count(1)
        self._put_ids = itertools.count(1)
        self.puts: dict[int, PutReservation] = {}

    # ------------------------------------------------------------------ queries
    def _prefix(self, namespace: str, hashes: Sequence[bytes]) -> list[Block]:
        out: list[Block] = []
        for h in hashes:
            blk = self._blocks.get((namespace, bytes(h)))
            if blk is None or blk.ghost:
                break
            out.append(blk)
        return out

    def _touch(self, blocks: list[Block]) -> None:
        for blk in blocks:  # chain order: a child is always more recent than its parent
            blk.last_used = next(self._tick)
            self._maybe_evictable(blk)

    def contains(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Longest stored prefix, without touching or counting (inspection)."""
        return len(self._prefix(namespace, hashes))

    def block_bytes_of(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Size of the chain's first block (0 when not stored)."""
        blocks = self._prefix(namespace, hashes[:1])
        return blocks[0].nbytes if blocks else 0

    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Longest stored prefix of the chain (touches it; counts hits/misses in blocks)."""
        hit = self._prefix(namespace, hashes)
        self._touch(hit)
        self.stats.hits += len(hit)
        self.stats.disk_hits += sum(1 for b in hit if b.slot is None)
        self.stats.misses += len(hashes) - len(hit)
        return len(hit)

    def acquire(self, namespace: str, hashes: Sequence[bytes]) -> list[Block]:
        """Reference the stored prefix for a fetch (no eviction until `release`)."""
        blocks = self._prefix(namespace, hashes)
        self._touch(blocks)
        for blk in blocks:
            blk.refs += 1
        return blocks

    def release(self, blocks: Sequence[Block]) -> None:
        for blk in blocks:
            blk.refs -= 1
            self._maybe_evictable(blk)

    def gather(
        self, blocks: Sequence[Block], out: np.ndarray, disk: DiskFiles | None = None
    ) -> int:
        """Copy referenced blocks into `out` back to back, RAM copies from the arena, the others
        from their files (`disk`; verified). Thread-safe for acquired blocks. Returns how many
        leading blocks are good: a corrupt or missing file ends the prefix there."""
        pos = 0
        for i, blk in enumerate(blocks):
            n, slot = blk.nbytes, blk.slot
            if slot is not None:
                out[pos : pos + n] = self.arena.view(slot)
            elif disk is None or not disk.read(blk.disk_name, blk.meta(), out[pos : pos + n]):
                return i
            pos += n
        return len(blocks)

    # ------------------------------------------------------------------ puts
    def begin_put(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        first_block: int,
        block_bytes: int,
        writer: str = "",
        window: bool = False,
    ) -> PutReservation | None:
        """Reserve slots for the blocks of the chain not stored yet, from the first missing one.
        None = nothing wanted (all stored). A reservation with no slots = rejected (parent
        missing, wrong size, or no room). `window`: the blocks' window parts (window.py)."""
        self._validate(hashes, first_block, block_bytes)
        if window:
            return self._begin_window_put(namespace, hashes, first_block, block_bytes, writer)
        start = len(self._prefix(namespace, hashes))
        if start == len(hashes):
            return None
        res = PutReservation(
            next(self._put_ids), namespace, [], start, block_bytes, None, writer=writer
        )
        if start < first_block or (self.block_bytes and block_bytes != self.block_bytes):
            self.stats.put_rejected += 1  # parent not stored: the chain would have a hole
            return res
        if start > 0:
            res.parent = self._blocks[(namespace, bytes(hashes[start - 1]))]
            res.parent.refs += 1
        return self._reserve(res, hashes[start:])

    def _reserve(self, res: PutReservation, hashes: Sequence[bytes]) -> PutReservation:
        """Slots for `hashes` in order, as room allows; none = rejected (released)."""
        for h in hashes:
            slot = self._alloc(res.block_bytes)
            if slot is None:
                break
            res.slots.append(slot)
            res.hashes.append(bytes(h))
        if not res.slots:
            self.stats.put_rejected += 1
            self._release_put(res)
            return res
        self.puts[res.put_id] = res
        return res

    def write_put(self, res: PutReservation, data: np.ndarray, checksums: Sequence[bytes]) -> bool:
        """Verify each received block against the sender's checksum, then copy it into its
        reserved slot. Thread-safe (touches only reserved slots). False = corrupt/short."""
        n = res.block_bytes
        if len(checksums) < len(res.slots) or data.nbytes < res.nbytes:
            return False
        for i in range(len(res.slots)):
            if checksum(data[i * n : (i + 1) * n]) != bytes(checksums[i]):
                return False
        for i, slot in enumerate(res.slots):
            self.arena.view(slot)[:] = data[i * n : (i + 1) * n]
        return True

    def commit_put(self, put_id: int, checksums: Sequence[bytes]) -> int:
        """Publish a written put; blocks stored meanwhile by another put are skipped (a ghost
        is revived with the new bytes)."""
        res = self.puts.pop(put_id)
        parent, stored = res.parent, 0
        for i, (h, slot) in enumerate(zip(res.hashes, res.slots, strict=True)):
            key = (res.namespace, h)
            blk = self._blocks.get(key)
            if blk is not None and not blk.ghost:
                self.arena.free(slot)
                parent = blk if res.chained else None
                continue
            if blk is not None:  # a ghost: same key, so same parent and position
                blk.slot, blk.checksum = slot, bytes(checksums[i])
            else:
                depth = res.first_block + i if res.chained else 0
                blk = Block(
                    key, parent, slot, bytes(checksums[i]), depth,
                    nbytes=res.block_bytes, writer=res.writer,
                )  # fmt: skip
                self._blocks[key] = blk
                if parent is not None:
                    parent.children += 1
            if self.disk_capacity:
                self._unwritten.append(blk)
            self._touch([blk])
            parent, stored = (blk if res.chained else None), stored + 1
        res.slots = []
        self._release_put(res)
        self.stats.bytes_in += stored * res.block_bytes
        return stored

    def abort_put(self, put_id: int, *, corrupt: bool = False) -> None:
        res = self.puts.pop(put_id, None)
        if res is None:
            return
        for slot in res.slots:
            self.arena.free(slot)
        res.slots = []
        self._release_put(res)
        if corrupt:
            self.stats.corrupt_puts += 1

    def _release_put(self, res: PutReservation) -> None:
        if res.parent is not None:
            self.release([res.parent])
            res.parent = None

    def _validate(self, hashes: Sequence[bytes], first_block: int, block_bytes: int) -> None:
        if any(len(h) != HASH_BYTES for h in hashes):
            raise InvalidRequestError("block_hashes", f"each hash must be {HASH_BYTES} bytes")
        if not 0 <= first_block <= len(hashes):
            raise InvalidRequestError("first_block", f"must be in [0, {len(hashes)}]")
        if block_bytes <= 0:
            raise InvalidRequestError("bytes_per_block", "must be > 0")

    # ------------------------------------------------------------------ eviction
    def _maybe_evictable(self, blk: Block) -> None:
        """Queue `blk` in the LRU heaps it now qualifies for (entries are checked on pop)."""
        if self._blocks.get(blk.key) is not blk or blk.refs:
            return
        if blk.ghost:
            if blk.children == 0:
                self._remove(blk)
            return
        if blk.pins:
            return
        entry = (blk.last_used, id(blk), blk)
        if blk.slot is not None and (blk.children == 0 or blk.on_disk):
            heap = self._lru.setdefault(blk.nbytes, [])
            heapq.heappush(heap, entry)
            if len(heap) > 4 * len(self._blocks) + 64:
                self._lru[blk.nbytes] = self._live(lambda b: self._ram_ok(b, blk.nbytes))
        if blk.on_disk and blk.children == 0:
            heapq.heappush(self._disk_lru, entry)
            if len(self._disk_lru) > 4 * len(self._blocks) + 64:
                self._disk_lru = self._live(self._disk_ok)

    def _ram_ok(self, b: Block, size: int) -> bool:
        """May `b`'s RAM copy go (dropped if on disk, else `b` is evicted)?"""
        return (
            b.slot is not None
            and b.nbytes == size
            and not (b.refs or b.pins)
            and (b.children == 0 or b.on_disk)
        )

    @staticmethod
    def _disk_ok(b: Block) -> bool:
        return b.on_disk and not (b.children or b.refs or b.pins)

    def _live(self, ok) -> list[tuple[int, int, Block]]:
        live = [(b.last_used, id(b), b) for b in self._blocks.values() if ok(b)]
        heapq.heapify(live)
        return live

    def _pop(self, heap: list[tuple[int, int, Block]], ok) -> Block | None:
        while heap:
            stamp, _, blk = heapq.heappop(heap)
            if ok(blk) and stamp == blk.last_used and self._blocks.get(blk.key) is blk:
                return blk
        return None

    def _evict_one(self, size: int) -> bool:
        """Free one RAM slot of `size`: demote an LRU block that is on disk, or evict an LRU
        leaf that is not."""
        blk = self._pop(self._lru.get(size, []), lambda b: self._ram_ok(b, size))
        if blk is None:
            return False
        if blk.on_disk:
            assert blk.slot is not None
            self.arena.free(blk.slot)
            blk.slot = None
            self.stats.demotions += 1
            self._maybe_evictable(blk)
        else:
            self._remove(blk)
            self.stats.evictions += 1
        return True

    def _remove(self, blk: Block) -> None:
        del self._blocks[blk.key]
        if blk.slot is not None:
            self.arena.free(blk.slot)
            blk.slot = None
        if blk.on_disk:
            self.disk_used -= blk.nbytes
            self._unlinks.append(blk.disk_name)
            blk.on_disk = False
        if blk.parent is not None:
            blk.parent.children -= 1
            self._maybe_evictable(blk.parent)
        self._drop_window_part(blk)

    def _alloc(self, size: int) -> Slot | None:
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
