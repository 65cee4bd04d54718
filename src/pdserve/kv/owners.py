"""The owners of KV block references that KVCacheManager tracks (no torch): what it needs of a
running sequence (`SeqBlocks`), what a request id owns outside one (`RequestKV`), and the
insertion of fetched blocks into a pool's prefix cache (`import_into`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.kv.block_pool import BlockPool
from pdserve.kv.window_group import NULL_BLOCK


class SeqBlocks(Protocol):
    """What the manager needs of a sequence (engine.sequence.Sequence)."""

    request_id: str
    block_table: list[int]
    window_table: list[int]  # window group's table ([] without one); NULL_BLOCK = freed
    num_window_freed: int  # leading entries of window_table already NULL
    block_hashes: list[bytes]
    num_computed_tokens: int
    num_registered_blocks: int

    @property
    def all_token_ids(self) -> list[int]: ...

    def token_ids(self, start: int, stop: int) -> list[int]:
        """all_token_ids[start:stop] (0 <= start <= stop)."""
        ...


@dataclass
class RequestKV:
    """Block state a request id owns outside a running sequence's block table."""

    reserved: list[int] = field(default_factory=list)
    prefix_hold: list[int] = field(default_factory=list)
    finished_hold: list[int] = field(default_factory=list)
    hold_on_finish: bool = False
    # the window group's side (empty without one): a reservation is a whole logical table
    # (NULL entries before the window), holds are live block ids only
    w_reserved: list[int] = field(default_factory=list)
    w_prefix_hold: list[int] = field(default_factory=list)
    w_finished_hold: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(
            self.reserved or self.prefix_hold or self.finished_hold or self.hold_on_finish
            or self.w_reserved or self.w_prefix_hold or self.w_finished_hold
        )  # fmt: skip

    def blocks(self) -> Iterable[int]:
        yield from self.reserved
        yield from self.prefix_hold
        yield from self.finished_hold

    def window_blocks(self) -> Iterable[int]:
        yield from (b for b in self.w_reserved if b != NULL_BLOCK)
        yield from self.w_prefix_hold
        yield from self.w_finished_hold


def import_into(
    pool: BlockPool,
    hashes: Sequence[bytes],
    write: Callable[[list[int], list[int]], None],
    start: int = 0,
) -> int:
    """Insert the hashes of `hashes[start:]` that `pool` lacks (as many as it has free
    blocks) via `write(block_ids, indices into hashes)`."""
    todo = [i for i, h in enumerate(hashes) if i >= start and pool.lookup(h) is None]
    todo = todo[: pool.num_free_blocks]
    if not todo:
        return 0
    blocks = pool.allocate(len(todo))
    write(blocks, todo)
    for b, i in zip(blocks, todo, strict=True):
        pool.cache_block(b, hashes[i])
    pool.free(blocks)
    return len(todo)
