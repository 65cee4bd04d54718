"""BlockStore's admin operations: pins, clears, purges, stats and the integrity check.

A mixin of `BlockStore` (store.py), kept apart so that each module stays one job; it uses
the store's index (`_blocks`, `_prefix`, `_remove`, `_maybe_evictable`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pdserve.kvstore.stats import StoreStats
from pdserve.kvstore.window import is_window_namespace, window_namespace

if TYPE_CHECKING:
    from pdserve.kvstore.store import BlockStore


class AdminMixin:
    def pin(self: BlockStore, namespace: str, hashes: Sequence[bytes], delta: int = 1) -> int:
        """Pin (delta=1) or unpin (-1) the stored prefix; returns the blocks affected. Main
        parts only: a layered model's window parts stay LRU (window.py)."""
        blocks = self._prefix(namespace, hashes)
        if delta < 0:
            blocks = [b for b in blocks if b.pins > 0]
        for blk in blocks:
            blk.pins += delta
            self._maybe_evictable(blk)
        return len(blocks)

    def clear(self: BlockStore, namespace: str = "") -> int:
        """Drop every block of `namespace` (all when empty) not in use, pins included, and
        the window parts of its blocks (window.py)."""
        names = (namespace, window_namespace(namespace))
        victims = [b for b in self._blocks.values() if not namespace or b.key[0] in names]
        before = len(self._blocks)
        for blk in sorted(victims, key=lambda b: -b.depth):  # leaves first
            if blk.children == 0 and blk.refs == 0 and self._blocks.get(blk.key) is blk:
                self._remove(blk)  # (its window part may go with it)
        return before - len(self._blocks)

    def purge_writer(self: BlockStore, writer: str) -> tuple[int, int]:
        """Drop every block `writer` put and every block chained after one of them (its KV
        was computed over the writer's). Returns (removed, still in use: retry later)."""
        tainted: set[int] = set()
        for blk in sorted(self._blocks.values(), key=lambda b: b.depth):  # parents first
            if blk.writer == writer or (blk.parent is not None and id(blk.parent) in tainted):
                tainted.add(id(blk))
        victims = [b for b in self._blocks.values() if id(b) in tainted]
        before = len(self._blocks)
        for blk in sorted(victims, key=lambda b: -b.depth):  # leaves first
            if blk.children == 0 and blk.refs == 0 and self._blocks.get(blk.key) is blk:
                self._remove(blk)  # (its window part may go with it)
        in_use = sum(1 for b in victims if self._blocks.get(b.key) is b)
        return before - len(self._blocks), in_use

    def blocks_by_writer(self: BlockStore) -> dict[str, int]:
        out: dict[str, int] = {}
        for blk in self._blocks.values():
            out[blk.writer] = out.get(blk.writer, 0) + 1
        return out

    def snapshot(self: BlockStore) -> StoreStats:
        s = self.stats
        s.used_bytes = self.arena.used_bytes
        s.num_blocks = len(self._blocks)
        s.pinned_blocks = sum(1 for b in self._blocks.values() if b.pins > 0)
        s.disk_used_bytes = self.disk_used
        s.disk_blocks = sum(1 for b in self._blocks.values() if b.on_disk)
        return s

    def check_integrity(self: BlockStore) -> None:
        children: dict[int, int] = {}
        for blk in self._blocks.values():
            if blk.parent is not None:
                assert self._blocks.get(blk.parent.key) is blk.parent, "orphan block"
                children[id(blk.parent)] = children.get(id(blk.parent), 0) + 1
        for blk in self._blocks.values():
            assert blk.children == children.get(id(blk), 0), "child count drift"
            assert not blk.ghost or blk.children or blk.refs, "ghost left behind"
            if is_window_namespace(blk.key[0]):  # window parts: unchained leaves
                assert blk.parent is None and blk.depth == 0, "chained window part"
        reserved = sum(r.nbytes for r in self.puts.values())
        stored = sum(b.nbytes for b in self._blocks.values() if b.slot is not None)
        assert self.arena.used_bytes == reserved + stored, "slot accounting drift"
        assert self.arena.used_bytes <= self.stats.capacity_bytes
        on_disk = sum(b.nbytes for b in self._blocks.values() if b.on_disk or b.writing)
        assert self.disk_used == on_disk, "disk accounting drift"
        assert self.disk_used <= max(self.disk_capacity, 0)
