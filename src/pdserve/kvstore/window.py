"""WindowParts: the window parts of a layered model's blocks, over the store's BlockIndex
(bookkeeping only).

A layered KV layout (Gemma 4: sliding-window layers beside full-attention layers) splits each
block in two parts (the client splits and joins them, kv/store_parts.py):
- the *main* part, the full-attention layers: stored in the client's namespace as any block
  (chained: a block only after its parent; evicted from chain tails);
- the *window* part, the sliding layers: stored in `window_namespace(namespace)`, keyed by
  the same chained hash, with no parent rule (parent None, depth 0: every window part is a
  leaf of its own, evicted by LRU alone). Clients publish it for the last `window_blocks`
  blocks of a chain only, since that is all a hit at the chain's end reads.

A hit at k blocks needs main blocks [0, k) and window parts [max(0, k - wb), k) (wb: the
request's `window_blocks`). `lookup_window` / `acquire_window` serve the largest such k not
beyond the stored main prefix, so a missing window part makes a shorter hit or a miss, never
wrong KV. Multi-turn: turn 2's prompt extends turn 1's chain, so its hit is the end of turn 1's
publish, where turn 1's window parts are; turn 2's publish adds window parts at its own end
and leaves turn 1's to the LRU (a hit point for another continuation while they last).

A window part without its main block serves no hit (a hit at k needs main [0, k)), so removing
a main block (eviction, clear, purge) also removes the window part of the same hash, unless it
is referenced or pinned (then the LRU takes it later).

Main and window parts differ in size, so they live in different arena extents: the LRU is
exact within each size (BlockIndex.alloc evicts the slot's own size first; extents change
size only when one empties, `Arena.reclaim`).

Invariants (checked by `check_integrity`): a window part has no parent, no children and
depth 0, and lives only in a window namespace. Client namespaces cannot collide with one: the
suffix holds a NUL, which a client namespace (printable only, kvstore/checks.py) cannot.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.kvstore.blocks import Block, PutReservation
from pdserve.kvstore.index import BlockIndex

WINDOW_SUFFIX = "\x00window"


def window_namespace(namespace: str) -> str:
    """Where the window parts of `namespace`'s blocks live."""
    return namespace + WINDOW_SUFFIX


def is_window_namespace(namespace: str) -> bool:
    return namespace.endswith(WINDOW_SUFFIX)


class WindowParts:
    """Lookups, fetches and puts of window parts; removing a main block drops its part."""

    def __init__(self, index: BlockIndex) -> None:
        self.index = index
        index.on_remove.append(self._drop_part)

    def _window_hit(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        main: list[Block],
        window_blocks: int,
    ) -> tuple[int, list[Block]]:
        """(k, the window parts of blocks [max(0, k - window_blocks), k)) for the largest
        k <= len(main) whose window parts are all stored (k = 0: a miss)."""
        wns = window_namespace(namespace)
        parts: list[Block | None] = []
        for h in hashes[: len(main)]:
            blk = self.index.get((wns, bytes(h)))
            parts.append(None if blk is None or blk.ghost else blk)
        run = [0] * (len(parts) + 1)  # run[j]: stored parts ending at block j - 1
        for j, part in enumerate(parts, 1):
            run[j] = run[j - 1] + 1 if part is not None else 0
        for k in range(len(parts), 0, -1):
            need = min(k, window_blocks)
            if run[k] >= need:
                return k, [p for p in parts[k - need : k] if p is not None]
        return 0, []

    def lookup(
        self, namespace: str, hashes: Sequence[bytes], window_blocks: int
    ) -> tuple[int, int]:
        """(hit k, stored main prefix) of a layered chain; touches the hit (its main blocks,
        then its window parts) and counts hits/misses in blocks, as `BlockStore.lookup`."""
        main = self.index.prefix(namespace, hashes)
        k, parts = self._window_hit(namespace, hashes, main, window_blocks)
        self.index.touch(main[:k])
        self.index.touch(parts)
        self.index.stats.hits += k
        self.index.stats.disk_hits += sum(1 for b in main[:k] if b.slot is None)
        self.index.stats.misses += len(hashes) - k
        return k, len(main)

    def acquire(
        self, namespace: str, hashes: Sequence[bytes], window_blocks: int
    ) -> tuple[list[Block], list[Block]]:
        """Reference a layered hit for a fetch: (main blocks [0, k), window parts of
        [max(0, k - window_blocks), k)); `release` both lists after."""
        main = self.index.prefix(namespace, hashes)
        k, parts = self._window_hit(namespace, hashes, main, window_blocks)
        main = main[:k]
        self.index.touch(main)
        self.index.touch(parts)
        for blk in (*main, *parts):
            blk.refs += 1
        return main, parts

    def _drop_part(self, blk: Block) -> None:
        """`blk` (a main block) left the store: its window part can serve no hit now."""
        if is_window_namespace(blk.key[0]):
            return
        part = self.index.get((window_namespace(blk.key[0]), blk.key[1]))
        if part is not None and not (part.refs or part.pins or part.writing):
            self.index.remove(part)

    def plan_put(
        self,
        put_id: int,
        namespace: str,
        hashes: Sequence[bytes],
        first_block: int,
        block_bytes: int,
        writer: str,
    ) -> tuple[PutReservation, Sequence[bytes]] | None:
        """The put of the window parts of blocks [s, len) of the chain, s = the first block
        at or after `first_block` whose part is not stored (no parent rule), and the hashes to
        reserve slots for (none: rejected). None = nothing wanted. A part stored between s and
        the end keeps its slot reserved until commit, which skips it."""
        wns = window_namespace(namespace)
        start = next(
            (
                i
                for i in range(first_block, len(hashes))
                if (blk := self.index.get((wns, bytes(hashes[i])))) is None or blk.ghost
            ),
            None,
        )
        if start is None:
            return None
        res = PutReservation(
            put_id, wns, [], start, block_bytes, None, writer=writer, chained=False
        )
        if self.index.block_bytes and block_bytes != self.index.block_bytes:
            self.index.stats.put_rejected += 1  # a store of one block size holds no second part
            return res, []
        return res, hashes[start:]
