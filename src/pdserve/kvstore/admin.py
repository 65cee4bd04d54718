"""StoreAdmin: the kvstore's admin operations on its BlockIndex: pins, clears, purges."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.kvstore.index import BlockIndex
from pdserve.kvstore.window import window_namespace


class StoreAdmin:
    def __init__(self, index: BlockIndex) -> None:
        self.index = index

    def pin(self, namespace: str, hashes: Sequence[bytes], delta: int = 1) -> int:
        """Pin (delta=1) or unpin (-1) the stored prefix; returns the blocks affected. Main
        parts only: a layered model's window parts stay LRU (window.py)."""
        blocks = self.index.prefix(namespace, hashes)
        if delta < 0:
            blocks = [b for b in blocks if b.pins > 0]
        for blk in blocks:
            blk.pins += delta
            self.index.maybe_evictable(blk)
        return len(blocks)

    def clear(self, namespace: str = "") -> int:
        """Drop every block of `namespace` (all when empty) not in use, pins included, and
        the window parts of its blocks (window.py)."""
        names = (namespace, window_namespace(namespace))
        victims = [b for b in self.index if not namespace or b.key[0] in names]
        before = len(self.index)
        for blk in sorted(victims, key=lambda b: -b.depth):  # leaves first
            if blk.children == 0 and blk.refs == 0 and self.index.holds(blk):
                self.index.remove(blk)  # (its window part may go with it)
        return before - len(self.index)

    def purge_writer(self, writer: str) -> tuple[int, int]:
        """Drop every block `writer` put and every block chained after one of them (its KV
        was computed over the writer's). Returns (removed, still in use: retry later)."""
        tainted: set[int] = set()
        for blk in sorted(self.index, key=lambda b: b.depth):  # parents first
            if blk.writer == writer or (blk.parent is not None and id(blk.parent) in tainted):
                tainted.add(id(blk))
        victims = [b for b in self.index if id(b) in tainted]
        before = len(self.index)
        for blk in sorted(victims, key=lambda b: -b.depth):  # leaves first
            if blk.children == 0 and blk.refs == 0 and self.index.holds(blk):
                self.index.remove(blk)  # (its window part may go with it)
        in_use = sum(1 for b in victims if self.index.holds(b))
        return before - len(self.index), in_use

    def blocks_by_writer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for blk in self.index:
            out[blk.writer] = out.get(blk.writer, 0) + 1
        return out
