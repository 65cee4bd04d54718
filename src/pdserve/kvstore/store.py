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
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.errors import InvalidRequestError
from pdserve.kvstore.arena import Arena, Slot
from pdserve.kvstore.stats import StoreStats

HASH_BYTES = 16
Key = tuple[str, bytes]


def checksum(data: np.ndarray) -> bytes:
    """blake2b-128 of a block's bytes (the wire checksum of Fetch and CommitPut)."""
    return hashlib.blake2b(memoryview(data), digest_size=16).digest()


@dataclass(eq=False)
class Block:
    key: Key
    parent: Block | None
    slot: Slot
    checksum: bytes
    depth: int  # position in its chain (0 = first block)
    children: int = 0
    pins: int = 0
    refs: int = 0
    last_used: int = 0
    writer: str = ""  # identity (certificate URI) of the worker that put it; "" = anonymous


@dataclass(eq=False)
class PutReservation:
    put_id: int
    namespace: str
    hashes: list[bytes]  # the accepted blocks, in chain order
    first_block: int  # chain position of hashes[0]
    block_bytes: int
    parent: Block | None  # referenced until commit/abort so it cannot be evicted
    slots: list[Slot] = field(default_factory=list)
    writer: str = ""

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.block_bytes


class BlockStore:
    def __init__(self, capacity_bytes: int, block_bytes: int = 0, extent_bytes: int = 0) -> None:
        """`block_bytes` > 0: only that block size, one extent = the whole arena. Otherwise
        extents of `extent_bytes` (default capacity/16, at least 1 MiB) serve any size."""
        if block_bytes > 0:
            extent_bytes = (capacity_bytes // block_bytes) * block_bytes
        elif extent_bytes <= 0:
            extent_bytes = min(capacity_bytes, max(capacity_bytes // 16, 1 << 20))
        self.block_bytes = block_bytes
        self.arena = Arena(capacity_bytes, extent_bytes)
        self.stats = StoreStats(capacity_bytes=self.arena.capacity_bytes)
        self._blocks: dict[Key, Block] = {}
        self._lru: dict[int, list[tuple[int, Block]]] = {}  # slot size -> heap (last_used, blk)
        self._tick = itertools.count(1)
        self._put_ids = itertools.count(1)
        self.puts: dict[int, PutReservation] = {}

    # ------------------------------------------------------------------ queries
    def _prefix(self, namespace: str, hashes: Sequence[bytes]) -> list[Block]:
        out: list[Block] = []
        for h in hashes:
            blk = self._blocks.get((namespace, bytes(h)))
            if blk is None:
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
        """Slot size of the chain's first block (0 when not stored)."""
        blocks = self._prefix(namespace, hashes[:1])
        return blocks[0].slot.nbytes if blocks else 0

    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Longest stored prefix of the chain (touches it; counts hits/misses in blocks)."""
        hit = self._prefix(namespace, hashes)
        self._touch(hit)
        self.stats.hits += len(hit)
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

    def gather(self, blocks: Sequence[Block], out: np.ndarray) -> None:
        """Copy referenced blocks into `out` back to back (thread-safe for acquired blocks)."""
        pos = 0
        for blk in blocks:
            n = blk.slot.nbytes
            out[pos : pos + n] = self.arena.view(blk.slot)
            pos += n

    # ------------------------------------------------------------------ puts
    def begin_put(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        first_block: int,
        block_bytes: int,
        writer: str = "",
    ) -> PutReservation | None:
        """Reserve slots for the blocks of the chain not stored yet, from the first missing one.
        None = nothing wanted (all stored). A reservation with no slots = rejected (parent
        missing, wrong size, or no room)."""
        self._validate(hashes, first_block, block_bytes)
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
        for h in hashes[start:]:
            slot = self._alloc(block_bytes)
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
        """Publish a written put; blocks stored meanwhile by another put are skipped."""
        res = self.puts.pop(put_id)
        parent, stored = res.parent, 0
        for i, (h, slot) in enumerate(zip(res.hashes, res.slots, strict=True)):
            key = (res.namespace, h)
            existing = self._blocks.get(key)
            if existing is not None:
                self.arena.free(slot)
                parent = existing
                continue
            blk = Block(
                key, parent, slot, bytes(checksums[i]), res.first_block + i, writer=res.writer
            )
            self._blocks[key] = blk
            if parent is not None:
                parent.children += 1
            self._touch([blk])
            parent, stored = blk, stored + 1
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
        if (
            blk.children == 0
            and blk.pins == 0
            and blk.refs == 0
            and self._blocks.get(blk.key) is blk
        ):
            heap = self._lru.setdefault(blk.slot.nbytes, [])
            heapq.heappush(heap, (blk.last_used, id(blk), blk))
            if len(heap) > 4 * len(self._blocks) + 64:
                self._compact(blk.slot.nbytes)

    def _compact(self, size: int) -> None:
        live = [
            (b.last_used, id(b), b)
            for b in self._blocks.values()
            if b.slot.nbytes == size and b.children == 0 and b.pins == 0 and b.refs == 0
        ]
        heapq.heapify(live)
        self._lru[size] = live

    def _evict_one(self, size: int) -> bool:
        heap = self._lru.get(size, [])
        while heap:
            stamp, _, blk = heapq.heappop(heap)
            ok = blk.children == 0 and blk.pins == 0 and blk.refs == 0
            if ok and stamp == blk.last_used and self._blocks.get(blk.key) is blk:
                self._remove(blk)
                self.stats.evictions += 1
                return True
        return False

    def _remove(self, blk: Block) -> None:
        del self._blocks[blk.key]
        self.arena.free(blk.slot)
        if blk.parent is not None:
            blk.parent.children -= 1
            self._maybe_evictable(blk.parent)

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

    # ------------------------------------------------------------------ admin
    def pin(self, namespace: str, hashes: Sequence[bytes], delta: int = 1) -> int:
        """Pin (delta=1) or unpin (-1) the stored prefix; returns the blocks affected."""
        blocks = self._prefix(namespace, hashes)
        if delta < 0:
            blocks = [b for b in blocks if b.pins > 0]
        for blk in blocks:
            blk.pins += delta
            self._maybe_evictable(blk)
        return len(blocks)

    def clear(self, namespace: str = "") -> int:
        """Drop every block of `namespace` (all when empty) not in use, pins included."""
        victims = [b for b in self._blocks.values() if not namespace or b.key[0] == namespace]
        removed = 0
        for blk in sorted(victims, key=lambda b: -b.depth):  # leaves first
            if blk.children == 0 and blk.refs == 0:
                self._remove(blk)
                removed += 1
        return removed

    def purge_writer(self, writer: str) -> tuple[int, int]:
        """Drop every block `writer` put and every block chained after one of them (its KV
        was computed over the writer's). Returns (removed, still in use: retry later)."""
        tainted: set[int] = set()
        for blk in sorted(self._blocks.values(), key=lambda b: b.depth):  # parents first
            if blk.writer == writer or (blk.parent is not None and id(blk.parent) in tainted):
                tainted.add(id(blk))
        victims = [b for b in self._blocks.values() if id(b) in tainted]
        removed = 0
        for blk in sorted(victims, key=lambda b: -b.depth):  # leaves first
            if blk.children == 0 and blk.refs == 0:
                self._remove(blk)
                removed += 1
        return removed, len(victims) - removed

    def blocks_by_writer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for blk in self._blocks.values():
            out[blk.writer] = out.get(blk.writer, 0) + 1
        return out

    def snapshot(self) -> StoreStats:
        s = self.stats
        s.used_bytes = self.arena.used_bytes
        s.num_blocks = len(self._blocks)
        s.pinned_blocks = sum(1 for b in self._blocks.values() if b.pins > 0)
        return s

    def check_integrity(self) -> None:
        children: dict[int, int] = {}
        for blk in self._blocks.values():
            if blk.parent is not None:
                assert self._blocks.get(blk.parent.key) is blk.parent, "orphan block"
                children[id(blk.parent)] = children.get(id(blk.parent), 0) + 1
        for blk in self._blocks.values():
            assert blk.children == children.get(id(blk), 0), "child count drift"
        reserved = sum(r.nbytes for r in self.puts.values())
        stored = sum(b.slot.nbytes for b in self._blocks.values())
        assert self.arena.used_bytes == reserved + stored, "slot accounting drift"
        assert self.arena.used_bytes <= self.stats.capacity_bytes
