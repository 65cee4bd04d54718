"""The sliding-window group of a layered KV layout (Gemma 4): its own block pool. No torch.

A layered spec with sliding layers (`KVSpec.window_group` = W) keeps two block pools:
the full-attention layers use the engine's main pool (`seq.block_table`), the sliding layers
this one (`seq.window_table`). Both tables have the same logical length (one entry per
`block_size` tokens of the context), but a window table entry whose block lies wholly before
the window of every future query is freed back to this pool and replaced by `NULL_BLOCK`.

Invariants:
- `NULL_BLOCK` (id 0) is allocated once when the group is built and never freed, written or
  registered: its tensor rows stay zero, so an attention gather that reads a freed entry
  reads finite keys (masked by the window, so they weigh exactly 0; 0 * NaN would poison it);
- entry i of a window table may be NULL only when i < first_needed(num_computed_tokens);
  positions at or after `num_computed_tokens` (this step's new tokens) are never in a NULL
  entry, so no step writes to it;
- a prefix hit at k blocks needs full-group blocks [0, k) and window blocks
  [first_needed(k * bs), k), all hash-addressed (one chain of hashes serves both pools).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pdserve.kv.block_pool import BlockPool

NULL_BLOCK = 0


class WindowGroup:
    def __init__(
        self, num_blocks: int, block_size: int, window: int, enable_prefix_caching: bool
    ) -> None:
        """`num_blocks` usable blocks; the pool has one more, the null block."""
        if window < 1:
            raise ValueError("window must be >= 1")
        self.window = window
        self.block_size = block_size
        self.pool = BlockPool(num_blocks + 1, block_size, enable_prefix_caching)
        null = self.pool.allocate(1)
        assert null == [NULL_BLOCK]
        self.num_blocks = num_blocks

    def first_needed(self, num_tokens: int) -> int:
        """First block a query at position >= num_tokens can read (keys > p - W); as
        `KVSpec.first_needed_block` for a sliding layer."""
        return max(0, num_tokens - self.window) // self.block_size

    def hit(self, hashes: Sequence[bytes], full_hits: list[int]) -> tuple[int, list[int]]:
        """The longest prefix hit given the full group's cached run `full_hits` of `hashes`:
        (k, window block ids of [first_needed(k * bs), k)). k <= len(full_hits)."""
        k = len(full_hits)
        present = [self.pool.lookup(h) for h in hashes[:k]]
        runs = [0] * (k + 1)  # runs[j]: cached window blocks ending at block j - 1
        for j in range(1, k + 1):
            runs[j] = runs[j - 1] + 1 if present[j - 1] is not None else 0
        for j in range(k, 0, -1):
            first = self.first_needed(j * self.block_size)
            if runs[j] >= j - first:
                return j, [b for b in present[first:j] if b is not None]
        return 0, []

    def live(self, table: Sequence[int]) -> list[int]:
        """The entries of a window table that hold a block of this pool (not NULL)."""
        return [b for b in table if b != NULL_BLOCK]

    def free(self, table: Sequence[int]) -> None:
        self.pool.free(self.live(table))

    def trim(self, seq: Any) -> int:
        """Free the entries of `seq.window_table` (a SeqBlocks) below
        first_needed(seq.num_computed_tokens): they become NULL. Returns the blocks freed."""
        table = seq.window_table
        upto = min(self.first_needed(seq.num_computed_tokens), len(table))
        start = seq.num_window_freed
        if upto <= start:
            return 0
        dropped = self.live(table[start:upto])
        self.pool.free(dropped)
        table[start:upto] = [NULL_BLOCK] * (upto - start)
        seq.num_window_freed = upto
        return len(dropped)

    def check_integrity(self, seqs: Iterable[Any], held: Iterable[Iterable[int]]) -> None:
        """Every block's ref count equals its owners: the window tables of `seqs` (every live
        SeqBlocks), the requests' window blocks `held`, and the group (the null block)."""
        self.pool.check_integrity()
        owned = {NULL_BLOCK: 1}
        tables = []
        for s in seqs:
            assert len(s.window_table) == len(s.block_table), f"{s.request_id}: table lengths"
            assert all(b == NULL_BLOCK for b in s.window_table[: s.num_window_freed])
            tables.append(self.live(s.window_table))
        for blocks in [*tables, *held]:
            for b in blocks:
                owned[b] = owned.get(b, 0) + 1
        for b in range(self.pool.num_blocks):
            rc = self.pool.ref_counts[b]
            assert rc == owned.get(b, 0), f"window block {b}: ref {rc}, {owned.get(b, 0)} owners"


def lone_request_blocks(block_size: int, window: int, step_tokens: int) -> int:
    """The most window blocks one request holds while a step of `step_tokens` new tokens
    runs: its window, the partial block, and the step's blocks."""
    return -(-window // block_size) + 2 + -(-step_tokens // block_size) + 1


def window_pool_sizes(
    block_bytes: tuple[int, int],
    block_size: int,
    window: int,
    *,
    step_tokens: int,
    max_num_seqs: int,
    kv_cache_bytes: int | None,
    num_blocks: int | None,
    window_blocks: int | None,
    default_blocks: int,
    max_model_len: int | None = None,
) -> tuple[int, int]:
    """(main pool blocks, window pool blocks) of an engine with a window group.

    A sequence holds at most ceil(W / bs) + 2 window blocks between steps (its window, the
    partial block, the one being filled) and one step's new tokens more while it runs, so
    the window pool wants `max_num_seqs` windows plus one step's tokens; never fewer than
    one request's most (else a lone long prompt could never run), and never more blocks
    than the main pool (a window table never holds more live blocks than the main table).
    - `num_blocks` given: the main pool has that many; the window pool `window_blocks`,
      else as many (it then never binds before the main pool);
    - `kv_cache_bytes` given: the window pool's share (its null block included) first, the
      rest to the main pool. The share is the larger of those `max_num_seqs` windows and
      the *balanced* share (`balanced_window_blocks`: both pools run out together when
      every sequence is `max_model_len` long), so a roomy budget keeps as many chains'
      windows cached as their full-attention blocks (prefix hits need both). Never more
      than an equal split: when the windows do not fit (a tight budget), the pools are
      equal, one pool's capacity. (Balancing a tight budget at `max_model_len` instead
      would shrink the window pool to a few sequences when max_model_len is far above the
      contexts served: Gemma 4's 256K);
    - else `default_blocks` main blocks (as the one-pool engine would have) and a window
      pool sized as above."""
    full_b, win_b = block_bytes
    per_seq = -(-window // block_size) + 2
    lone = lone_request_blocks(block_size, window, step_tokens)
    want = max(lone, max_num_seqs * per_seq + lone - per_seq)
    if num_blocks is not None:
        return num_blocks, window_blocks if window_blocks is not None else num_blocks
    if kv_cache_bytes is None:
        n = default_blocks
        return n, window_blocks if window_blocks is not None else min(n, want)
    budget = kv_cache_bytes - win_b  # the null block
    equal = budget // (full_b + win_b)
    if window_blocks is not None:
        n_w = window_blocks
    else:
        bal = (
            balanced_window_blocks(block_bytes, block_size, window, budget, max_model_len)
            if max_model_len
            else 0
        )
        n_w = max(want, bal)
        if n_w >= equal:
            return max(1, equal), max(1, equal)
    return max(1, (budget - n_w * win_b) // full_b), n_w


def balanced_window_blocks(
    block_bytes: tuple[int, int], block_size: int, window: int, budget: int, max_model_len: int
) -> int:
    """Window-pool blocks of a byte `budget` split so that both pools hold the same number
    of `max_model_len`-token sequences (ceil(L / bs) main blocks and ceil(W / bs) + 2 window
    blocks each)."""
    full_b, win_b = block_bytes
    per_seq = -(-window // block_size) + 2
    seqs = budget / (-(-max_model_len // block_size) * full_b + per_seq * win_b)
    return int(seqs * per_seq)
