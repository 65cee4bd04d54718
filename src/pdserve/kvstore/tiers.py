"""DiskTier: the disk tier's bookkeeping over the store's BlockIndex (no file I/O here).

The service drives it (service.py, `DiskWorker`): `take_writes` hands out committed blocks to
copy to disk (referenced, so their RAM copy stays put), `finish_writes` records the outcome;
`take_unlinks` hands out the files of removed blocks; `mark_bad` turns a block whose file read
back corrupt into a miss; `reserve_promotions` / `finish_promotions` copy disk-only blocks that
a fetch read back into RAM; `adopt` rebuilds the index from the files after a restart."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator, Sequence

from pdserve.kvstore.arena import Slot
from pdserve.kvstore.blocks import Block
from pdserve.kvstore.disk import DiskMeta, file_name, generation_of
from pdserve.kvstore.index import BlockIndex


class DiskTier:
    """Write-through copies of committed blocks on disk, sharing the store's index: the
    disk holds (nearly) a superset of RAM and one recency order serves both tiers."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        self._unwritten: deque[Block] = deque()  # committed, not yet scheduled for disk
        self._generation: Iterator[int] = itertools.count(1)

    @property
    def enabled(self) -> bool:
        return self.index.disk_capacity > 0

    def queue_write(self, blk: Block) -> None:
        """A committed block, to be copied to disk by the next `take_writes`."""
        self._unwritten.append(blk)

    def _disk_room(self, nbytes: int) -> bool:
        """Make room for `nbytes` on disk: the LRU leaf on disk loses its file, and leaves the
        store unless it also has a RAM copy (then it stays, in RAM only)."""
        while self.index.disk_used + nbytes > self.index.disk_capacity:
            blk = self.index.pop(self.index.disk_lru, self.index.disk_ok)
            if blk is None:
                return False
            if blk.slot is None:
                self.index.remove(blk)
                self.index.stats.evictions += 1
            else:
                blk.on_disk = False
                self.index.disk_used -= blk.nbytes
                self.index.unlinks.append(blk.disk_name)
                self.index.maybe_evictable(blk)
        return True

    def take_writes(self, max_bytes: int) -> list[Block]:
        """Committed RAM blocks to write to disk now (up to `max_bytes`, at least one), each
        referenced and its disk bytes reserved until `finish_writes`."""
        out: list[Block] = []
        taken = 0
        while self._unwritten and (not out or taken + self._unwritten[0].nbytes <= max_bytes):
            blk = self._unwritten.popleft()
            if not self.index.holds(blk) or blk.slot is None or blk.on_disk:
                continue  # gone, or already written
            if blk.writing or not self._disk_room(blk.nbytes):
                continue  # no leaf on disk can go now: it stays in RAM only
            blk.writing, blk.refs = True, blk.refs + 1
            blk.disk_name = file_name(blk.key[0], blk.key[1], next(self._generation))
            self.index.disk_used += blk.nbytes
            out.append(blk)
            taken += blk.nbytes
        return out

    def finish_writes(self, blocks: Sequence[Block], ok: Sequence[bool]) -> None:
        for blk, good in zip(blocks, ok, strict=True):
            blk.writing, blk.refs = False, blk.refs - 1
            if good:
                blk.on_disk = True
                self.index.stats.disk_writes += 1
            else:
                self.index.disk_used -= blk.nbytes
                self.index.unlinks.append(blk.disk_name)
            self.index.maybe_evictable(blk)

    @property
    def pending_writes(self) -> int:
        return len(self._unwritten)

    def drop_files(self, names: Sequence[str]) -> None:
        """Files no block owns (unreadable at start): deleted with the next unlinks."""
        self.index.unlinks.extend(names)

    def take_unlinks(self) -> list[str]:
        out, self.index.unlinks = self.index.unlinks, []
        return out

    def mark_bad(self, blk: Block) -> None:
        """`blk`'s file read back corrupt or short: drop the file; without a RAM copy the
        block becomes a ghost (a miss from here on; removed once unreferenced and childless)."""
        self.index.stats.disk_corrupt += 1
        if blk.on_disk and self.index.holds(blk):
            blk.on_disk = False
            self.index.disk_used -= blk.nbytes
            self.index.unlinks.append(blk.disk_name)
            self.index.maybe_evictable(blk)

    def reserve_promotions(self, blocks: Sequence[Block]) -> list[tuple[Block, Slot]]:
        """A RAM slot for each referenced disk-only block (as room allows, in order)."""
        out: list[tuple[Block, Slot]] = []
        for blk in blocks:
            if blk.slot is None and blk.on_disk:
                slot = self.index.alloc(blk.nbytes)
                if slot is None:
                    break
                out.append((blk, slot))
        return out

    def finish_promotions(self, pairs: Sequence[tuple[Block, Slot]]) -> None:
        """The slots of `reserve_promotions` now hold their blocks' bytes."""
        for blk, slot in pairs:
            if self.index.holds(blk) and blk.slot is None:
                blk.slot = slot
                self.index.stats.promotions += 1
                self.index.maybe_evictable(blk)
            else:
                self.index.arena.free(slot)

    def adopt(self, metas: Sequence[DiskMeta]) -> int:
        """Rebuild the index from the files found at start (headers only; the bytes are
        verified when read). Files whose parent is missing, duplicates, and what exceeds the
        disk budget (oldest first) are queued for unlinking. Returns blocks adopted."""
        by_age = sorted(metas, key=lambda m: m.mtime)
        stamp = {id(m): next(self.index.tick) for m in by_age}
        adopted: list[Block] = []
        for m in sorted(by_age, key=lambda m: m.depth):  # parents first
            key = (m.namespace, m.hash)
            parent = self.index.get((m.namespace, m.parent)) if m.depth else None
            orphan = m.depth > 0 and (parent is None or parent.depth != m.depth - 1)
            if orphan or self.index.get(key) is not None or m.nbytes <= 0:
                self.index.unlinks.append(m.name)
                continue
            blk = Block(
                key, parent, None, m.checksum, m.depth, nbytes=m.nbytes, disk_name=m.name,
                on_disk=True, writer=m.writer, last_used=stamp[id(m)],
            )  # fmt: skip
            self.index.add(blk)
            self.index.disk_used += m.nbytes
            adopted.append(blk)
        gens = [generation_of(b.disk_name) for b in adopted]
        self._generation = iter(range(max(gens, default=0) + 1, 1 << 62))
        for blk in adopted:
            self.index.maybe_evictable(blk)
        self._disk_room(0)  # a smaller --disk-bytes than last time: evict down to it
        return len(self.index)
