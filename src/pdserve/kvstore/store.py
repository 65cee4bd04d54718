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

The parts, composed (no mixins): `BlockIndex` (index.py) owns every block record, the LRU
heaps and eviction; `DiskTier` (tiers.py) the disk copies' bookkeeping; `WindowParts`
(window.py) the window parts; `StoreAdmin` (admin.py) pins, clears and purges. Each holds the
one index; this class is the put and fetch path over them.

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

import itertools
from collections.abc import Sequence

import numpy as np

from pdserve.errors import InvalidRequestError
from pdserve.kvstore.admin import StoreAdmin
from pdserve.kvstore.blocks import HASH_BYTES, Block, PutReservation, checksum
from pdserve.kvstore.disk import DiskFiles
from pdserve.kvstore.index import BlockIndex
from pdserve.kvstore.stats import StoreStats
from pdserve.kvstore.tiers import DiskTier
from pdserve.kvstore.window import WindowParts, is_window_namespace

__all__ = ["HASH_BYTES", "Block", "BlockStore", "PutReservation", "checksum"]


class BlockStore:
    def __init__(
        self,
        capacity_bytes: int,
        block_bytes: int = 0,
        extent_bytes: int = 0,
        disk_bytes: int = 0,
    ) -> None:
        """See `BlockIndex` for the sizes; `disk_bytes` > 0: a disk tier of that many block
        bytes (module docstring)."""
        self.index = BlockIndex(capacity_bytes, block_bytes, extent_bytes, disk_bytes)
        self.disk = DiskTier(self.index)
        self.windows = WindowParts(self.index)
        self.admin = StoreAdmin(self.index)
        self.stats = self.index.stats
        self.arena = self.index.arena
        self._put_ids = itertools.count(1)
        self.puts: dict[int, PutReservation] = {}

    # ------------------------------------------------------------------ queries
    def contains(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Longest stored prefix, without touching or counting (inspection)."""
        return len(self.index.prefix(namespace, hashes))

    def block_bytes_of(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Size of the chain's first block (0 when not stored)."""
        blocks = self.index.prefix(namespace, hashes[:1])
        return blocks[0].nbytes if blocks else 0

    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Longest stored prefix of the chain (touches it; counts hits/misses in blocks)."""
        hit = self.index.prefix(namespace, hashes)
        self.index.touch(hit)
        self.stats.hits += len(hit)
        self.stats.disk_hits += sum(1 for b in hit if b.slot is None)
        self.stats.misses += len(hashes) - len(hit)
        return len(hit)

    def acquire(self, namespace: str, hashes: Sequence[bytes]) -> list[Block]:
        """Reference the stored prefix for a fetch (no eviction until `release`)."""
        blocks = self.index.prefix(namespace, hashes)
        self.index.touch(blocks)
        for blk in blocks:
            blk.refs += 1
        return blocks

    def release(self, blocks: Sequence[Block]) -> None:
        self.index.release(blocks)

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
            planned = self.windows.plan_put(
                next(self._put_ids), namespace, hashes, first_block, block_bytes, writer
            )
            if planned is None:
                return None
            res, todo = planned
            return self._reserve(res, todo) if todo else res
        start = len(self.index.prefix(namespace, hashes))
        if start == len(hashes):
            return None
        res = PutReservation(
            next(self._put_ids), namespace, [], start, block_bytes, None, writer=writer
        )
        if start < first_block or (
            self.index.block_bytes and block_bytes != self.index.block_bytes
        ):
            self.stats.put_rejected += 1  # parent not stored: the chain would have a hole
            return res
        if start > 0:
            res.parent = self.index.blocks[(namespace, bytes(hashes[start - 1]))]
            res.parent.refs += 1
        return self._reserve(res, hashes[start:])

    def _reserve(self, res: PutReservation, hashes: Sequence[bytes]) -> PutReservation:
        """Slots for `hashes` in order, as room allows; none = rejected (released)."""
        for h in hashes:
            slot = self.index.alloc(res.block_bytes)
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
            blk = self.index.get(key)
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
                self.index.add(blk)
            if self.disk.enabled:
                self.disk.queue_write(blk)
            self.index.touch([blk])
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
            self.index.release([res.parent])
            res.parent = None

    def _validate(self, hashes: Sequence[bytes], first_block: int, block_bytes: int) -> None:
        if any(len(h) != HASH_BYTES for h in hashes):
            raise InvalidRequestError("block_hashes", f"each hash must be {HASH_BYTES} bytes")
        if not 0 <= first_block <= len(hashes):
            raise InvalidRequestError("first_block", f"must be in [0, {len(hashes)}]")
        if block_bytes <= 0:
            raise InvalidRequestError("bytes_per_block", "must be > 0")

    # ------------------------------------------------------------------ whole-store views
    def snapshot(self) -> StoreStats:
        s, ix = self.stats, self.index
        s.used_bytes = ix.arena.used_bytes
        s.num_blocks = len(ix)
        s.pinned_blocks = sum(1 for b in ix if b.pins > 0)
        s.disk_used_bytes = ix.disk_used
        s.disk_blocks = sum(1 for b in ix if b.on_disk)
        return s

    def check_integrity(self) -> None:
        ix = self.index
        children: dict[int, int] = {}
        for blk in ix:
            if blk.parent is not None:
                assert ix.holds(blk.parent), "orphan block"
                children[id(blk.parent)] = children.get(id(blk.parent), 0) + 1
        for blk in ix:
            assert blk.children == children.get(id(blk), 0), "child count drift"
            assert not blk.ghost or blk.children or blk.refs, "ghost left behind"
            if is_window_namespace(blk.key[0]):  # window parts: unchained leaves
                assert blk.parent is None and blk.depth == 0, "chained window part"
        reserved = sum(r.nbytes for r in self.puts.values())
        stored = sum(b.nbytes for b in ix if b.slot is not None)
        assert ix.arena.used_bytes == reserved + stored, "slot accounting drift"
        assert ix.arena.used_bytes <= self.stats.capacity_bytes
        on_disk = sum(b.nbytes for b in ix if b.on_disk or b.writing)
        assert ix.disk_used == on_disk, "disk accounting drift"
        assert ix.disk_used <= max(ix.disk_capacity, 0)
