"""KVCacheManager: the one owner of KV block state above `BlockPool` (no torch).

Every block reference an engine takes or drops goes through here, under a named owner:

- a running sequence owns its `block_table` (allocate its first chunk with prefix hits, grow
  it, free it on finish or preemption);
- a request id owns typed side state in `RequestKV`:
  * `reserved`: blocks a decode reserved for a request whose KV arrives from elsewhere; they
    become the sequence's own when it is admitted (`claim_reservation`);
  * `prefix_hold`: the cached prefix held (one ref each) from a kvstore import until the
    request is scheduled, so eviction cannot break it while the request waits;
  * `finished_hold`: a finished request's computed full blocks, held until they are published
    to the kvstore (`hold_on_finish` asks for it);
- the prefix cache (hash -> block) is filled by `register_computed` and `import_blocks`.

With a sliding window group (`window`, kv/window_group.py: Gemma 4's sliding layers) every
owner above has a second list for the window pool (`seq.window_table`, `w_*` in RequestKV);
capacity checks (`has_room`, `allocate_first_chunk`, `reserve`) count both pools, and
`trim_window` frees a sequence's window blocks that left the window of every future query.

`release(request_id)` drops every piece of a request's side state; it is idempotent, so a
caller that lost track (cancelled, timed out, aborted twice) can always call it again.
`check_integrity` proves that every block's ref count equals its owners.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.kv.block_pool import BlockPool, PrefixCacheStats
from pdserve.kv.hashing import block_hashes, root_hash
from pdserve.kv.owners import RequestKV, SeqBlocks, import_into
from pdserve.kv.window_group import NULL_BLOCK, WindowGroup


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        kv_fingerprint: str,
        window: int | None = None,
        window_blocks: int | None = None,
    ) -> None:
        """`window` (tokens): keep a sliding window group of `window_blocks` blocks (default
        `num_blocks`) beside the main pool; None = one group (today's layout)."""
        self._pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._w: WindowGroup | None = None
        if window is not None:
            n_w = num_blocks if window_blocks is None else window_blocks
            self._w = WindowGroup(n_w, block_size, window, enable_prefix_caching)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_fingerprint = kv_fingerprint
        self._root = root_hash(kv_fingerprint)
        self._requests: dict[str, RequestKV] = {}

    # ---- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks allocatable now (cached blocks with no owner included)."""
        return self._pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self._pool.num_cached_blocks

    @property
    def window(self) -> int | None:
        """The window group's window in tokens; None without one."""
        return None if self._w is None else self._w.window

    @property
    def num_window_blocks(self) -> int:
        return 0 if self._w is None else self._w.num_blocks

    @property
    def num_free_window_blocks(self) -> int:
        return 0 if self._w is None else self._w.pool.num_free_blocks

    def has_room(self, n: int, n_window: int | None = None) -> bool:
        """`n` more blocks fit in the main pool and `n_window` (default n) in the window's."""
        if n > self._pool.num_free_blocks:
            return False
        w = n if n_window is None else n_window
        return self._w is None or w <= self._w.pool.num_free_blocks

    def first_needed(self, num_tokens: int) -> int:
        """First window-table entry a query at position >= num_tokens reads (0 w/o window)."""
        return 0 if self._w is None else self._w.first_needed(num_tokens)

    @property
    def stats(self) -> PrefixCacheStats:
        return self._pool.stats

    @property
    def num_reservations(self) -> int:
        return sum(1 for r in self._requests.values() if r.reserved)

    @property
    def num_reserved_blocks(self) -> int:
        return sum(len(r.reserved) for r in self._requests.values())

    @property
    def num_held_blocks(self) -> int:
        return sum(len(r.prefix_hold) + len(r.finished_hold) for r in self._requests.values())

    def ref_count(self, block_id: int) -> int:
        return self._pool.ref_counts[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def reserved_blocks(self, request_id: str, window: bool = False) -> list[int]:
        """A reservation's table: the main pool's, or (`window`) the window group's."""
        state = self._requests.get(request_id)
        if not state:
            return []
        return list(state.w_reserved if window else state.reserved)

    def _state(self, request_id: str) -> RequestKV:
        return self._requests.setdefault(request_id, RequestKV())

    def _tidy(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and not state:
            del self._requests[request_id]

    # ---- hashing / prefix cache ------------------------------------------------------
    def compute_block_hashes(self, token_ids: Sequence[int]) -> list[bytes]:
        """Chained hashes of the full blocks of `token_ids` under this kv_fingerprint."""
        return block_hashes(token_ids, self.block_size, self.kv_fingerprint)

    def seq_hashes(self, seq: SeqBlocks, n_blocks: int) -> list[bytes]:
        """Chained hashes of the first `n_blocks` full blocks of `seq` (memoised on it)."""
        self._fill_hashes(seq, n_blocks)
        return seq.block_hashes[:n_blocks]

    def _fill_hashes(self, seq: SeqBlocks, n_blocks: int) -> None:
        """Extend `seq.block_hashes` to (at least) its first `n_blocks` full blocks."""
        have = len(seq.block_hashes)
        if have < n_blocks:
            parent = seq.block_hashes[-1] if have else self._root
            toks = seq.token_ids(have * self.block_size, n_blocks * self.block_size)
            seq.block_hashes.extend(
                block_hashes(toks, self.block_size, self.kv_fingerprint, parent)
            )

    def _hit(self, hashes: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """The longest usable prefix of `hashes` cached here: (main pool block ids [0, k),
        window block ids [first_needed(k * bs), k)). No refs taken."""
        full = self._pool.find_prefix(hashes, record=False)
        if self._w is None:
            return full, []
        k, window = self._w.hit(hashes, full)
        return full[:k], window

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Main-pool block ids of the longest locally cached usable prefix of `hashes` (with
        a window group: its window blocks are cached too). No refs taken."""
        return self._hit(hashes)[0]

    def cached_run(self, hashes: Sequence[bytes], skip: int) -> tuple[list[int], list[int]]:
        """Block ids (main pool, window pool or [] without one) of `hashes[skip:]` whose
        blocks are cached here in every group, up to the first miss (no refs taken). A
        block's hash names its content whatever is cached before it, so the run may start
        past blocks this pool never registered (a decode's trimmed sliding-window prefix)."""
        out: list[int] = []
        wout: list[int] = []
        for h in hashes[skip:]:
            b = self._pool.lookup(h)
            w = None if self._w is None else self._w.pool.lookup(h)
            if b is None or (self._w is not None and w is None):
                break
            out.append(b)
            if w is not None:
                wout.append(w)
        return out, wout

    def register_computed(self, seq: SeqBlocks) -> None:
        """Publish the full blocks of `seq` whose K/V is computed to the prefix cache."""
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        done = seq.num_registered_blocks
        if n_full <= done:
            return
        self._fill_hashes(seq, n_full)
        hashes, table = seq.block_hashes, seq.block_table
        cache = self._pool.cache_block
        for i in range(done, n_full):
            cache(table[i], hashes[i])
        if self._w is not None:
            w_table, w_cache = seq.window_table, self._w.pool.cache_block
            for i in range(done, n_full):
                if w_table[i] != NULL_BLOCK:
                    w_cache(w_table[i], hashes[i])
        seq.num_registered_blocks = n_full

    def trim_window(self, seq: SeqBlocks) -> int:
        """Free `seq`'s window blocks that lie wholly before the window of every query at or
        after its `num_computed_tokens` (call `register_computed` first: they stay cached,
        evictable like any freed block). Returns the blocks freed."""
        return 0 if self._w is None else self._w.trim(seq)

    # ---- running sequences -----------------------------------------------------------
    def allocate_first_chunk(self, seq: SeqBlocks, budget: int, record: bool) -> int:
        """Give a waiting `seq` its prefix hits and blocks for its first chunk of at most
        `budget` new tokens. Returns the tokens to compute (0 = does not fit; nothing changed).
        Once placed, the request's prefix hold (if any) is dropped: the sequence holds it."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        num_tokens = len(seq.all_token_ids)
        hits: list[int] = []
        whits: list[int] = []
        max_hit_blocks = 0
        if self.enable_prefix_caching:
            # always recompute at least the last token (it produces the next logits)
            max_hit_blocks = (num_tokens - 1) // self.block_size
            hits, whits = self._hit(self.seq_hashes(seq, max_hit_blocks))
        hit_tokens = len(hits) * self.block_size
        num_new = min(num_tokens - hit_tokens, budget)
        need = self.blocks_for(hit_tokens + num_new) - len(hits)
        revived = sum(1 for b in hits if self._pool.ref_counts[b] == 0)
        if need + revived > self._pool.num_free_blocks:
            return 0
        if self._w is not None:
            w_revived = sum(1 for b in whits if self._w.pool.ref_counts[b] == 0)
            if need + w_revived > self._w.pool.num_free_blocks:
                return 0
            self._w.pool.touch(whits)
            head = len(hits) - len(whits)  # entries before the hit's window: NULL
            seq.window_table = [NULL_BLOCK] * head + whits + self._w.pool.allocate(need)
            seq.num_window_freed = head
        self._pool.touch(hits)
        seq.block_table = hits + self._pool.allocate(need)
        seq.num_computed_tokens = hit_tokens
        seq.num_registered_blocks = len(hits)
        if record:
            self._pool.record_lookup(max_hit_blocks, len(hits))
        self._drop_prefix_hold(seq.request_id)
        return num_new

    def blocks_to_grow(self, seq: SeqBlocks, num_tokens: int) -> int:
        """Blocks `seq` needs beyond its table to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def grow(self, seq: SeqBlocks, num_tokens: int) -> None:
        """Extend `seq`'s tables to hold `num_tokens` tokens (caller checked `has_room`)."""
        n = self.blocks_to_grow(seq, num_tokens)
        seq.block_table.extend(self._pool.allocate(n))
        if self._w is not None:
            seq.window_table.extend(self._w.pool.allocate(n))

    def free(self, seq: SeqBlocks, finished: bool = False) -> None:
        """Release a sequence's blocks (full computed blocks stay cached). With `finished` and
        `hold_on_finish` asked for its request, its computed full blocks stay held until
        `release`, for the kvstore publish."""
        self.register_computed(seq)
        state = self._requests.get(seq.request_id)
        if finished and state is not None and state.hold_on_finish:
            state.hold_on_finish = False
            n = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
            keep = seq.block_table[:n]
            self._pool.touch(keep)
            state.finished_hold.extend(keep)
            if self._w is not None:
                w_keep = self._w.live(seq.window_table[:n])
                self._w.pool.touch(w_keep)
                state.w_finished_hold.extend(w_keep)
        self._pool.free(seq.block_table)
        seq.block_table = []
        if self._w is not None:
            self._w.free(seq.window_table)
            seq.window_table = []
            seq.num_window_freed = 0
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        self._tidy(seq.request_id)

    # ---- decode reservations ---------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int, num_kv_tokens: int = 0) -> list[int]:
        """Reserve blocks for `num_tokens` tokens of a request whose KV arrives from elsewhere.
        With a window group, the KV of its first `num_kv_tokens` tokens arrives trimmed to
        the window: its window table starts with first_needed(num_kv_tokens) NULL entries.
        Registered under `request_id` before returning, so `release(request_id)` frees them
        whatever happens to the caller. Returns the main pool's blocks."""
        state = self._requests.get(request_id)
        if state is not None and state.reserved:
            raise InvalidRequestError("request_id", f"{request_id!r} already has a reservation")
        n = self.blocks_for(num_tokens)
        head = min(n, self.first_needed(num_kv_tokens))
        if not self.has_room(n, n - head):
            raise OverloadedError(
                f"need {n} KV blocks ({n - head} in the window pool), "
                f"{self._pool.num_free_blocks} free ({self.num_free_window_blocks})"
            )
        blocks = self._pool.allocate(n)
        state = self._state(request_id)
        state.reserved = blocks
        if self._w is not None:
            state.w_reserved = [NULL_BLOCK] * head + self._w.pool.allocate(n - head)
        return list(blocks)

    def claim_reservation(self, request_id: str) -> list[int]:
        """Hand a reservation's blocks to the sequence being admitted (they leave the
        reservation; the sequence frees them). [] when there is none. One group only: with
        a window group use `admit_reservation`."""
        assert self._w is None, "a window group's reservation: use admit_reservation"
        state = self._requests.get(request_id)
        if state is None or not state.reserved:
            return []
        blocks, state.reserved = state.reserved, []
        self._tidy(request_id)
        return blocks

    def admit_reservation(self, seq: SeqBlocks, num_kv_tokens: int) -> bool:
        """Make `seq.request_id`'s reservation the tables of `seq`, whose first
        `num_kv_tokens` tokens' KV it holds (the window group's entries before that KV's
        window are freed unregistered: they never received it). False when there is none."""
        state = self._requests.get(seq.request_id)
        if state is None or not state.reserved:
            return False
        seq.block_table, state.reserved = state.reserved, []
        if self._w is not None:
            seq.window_table, state.w_reserved = state.w_reserved, []
            head = min(self._w.first_needed(num_kv_tokens), len(seq.window_table))
            self._w.free(seq.window_table[:head])
            seq.window_table[:head] = [NULL_BLOCK] * head
            seq.num_window_freed = head
        self._tidy(seq.request_id)
        return True

    # ---- holds -----------------------------------------------------------------------
    def hold_prefix(self, request_id: str, hashes: Sequence[bytes]) -> int:
        """Hold the longest locally cached prefix of `hashes` until `request_id` is scheduled
        (or released). Returns the blocks held."""
        blocks, w_blocks = self._hit(hashes)
        self._pool.touch(blocks)
        state = self._state(request_id)
        state.prefix_hold.extend(blocks)
        if self._w is not None:
            self._w.pool.touch(w_blocks)
            state.w_prefix_hold.extend(w_blocks)
        return len(blocks)

    def hold_on_finish(self, request_id: str) -> None:
        """When `request_id` finishes normally, keep its computed full blocks until
        `release(request_id)`."""
        self._state(request_id).hold_on_finish = True

    def _drop_prefix_hold(self, request_id: str) -> None:
        state = self._requests.get(request_id)
        if state is not None and state.prefix_hold:
            blocks, state.prefix_hold = state.prefix_hold, []
            self._pool.free(blocks)
            if self._w is not None:
                w_blocks, state.w_prefix_hold = state.w_prefix_hold, []
                self._w.pool.free(w_blocks)
            self._tidy(request_id)

    def release(self, request_id: str) -> int:
        """Drop everything `request_id` owns outside a running sequence: its reservation, its
        holds, its hold-on-finish wish. Idempotent. Returns the blocks released."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return 0
        n = 0
        for blocks in (state.reserved, state.prefix_hold, state.finished_hold):
            if blocks:
                self._pool.free(blocks)
                n += len(blocks)
        if self._w is not None:
            for blocks in (state.w_reserved, state.w_prefix_hold, state.w_finished_hold):
                self._w.free(blocks)
        return n

    # ---- import / read -----------------------------------------------------------------
    def import_blocks(
        self,
        hashes: Sequence[bytes],
        write: Callable[[list[int], list[int]], None],
        write_window: Callable[[list[int], list[int]], None] | None = None,
        window_from: int = 0,
    ) -> int:
        """Insert blocks fetched from elsewhere into the prefix cache. `write(block_ids,
        indices)` copies data[indices] into block_ids of the main pool, `write_window` into
        the window group's pool: the chain's tail only, the window of a hit at its end (each
        pool skips the hashes it already caches; none before `window_from`, whose window
        layers were not fetched). The new blocks stay free and cached. Returns the number
        inserted into the main pool."""
        if not self.enable_prefix_caching:
            return 0
        if self._w is not None:
            assert write_window is not None, "a window group needs write_window"
            # a hit at k (the chain's end, or one block less: the last token is recomputed)
            # needs window blocks [k - ceil(W / bs), k)
            tail = max(0, len(hashes) - (-(-self._w.window // self.block_size) + 2))
            tail = max(tail, window_from)
            import_into(self._w.pool, hashes, write_window, tail)
        return import_into(self._pool, hashes, write)

    # ---- checks ----------------------------------------------------------------------
    def check_integrity(self, seqs: Iterable[SeqBlocks]) -> None:
        """Raise AssertionError unless every block's ref count equals its owners: the block
        tables of `seqs` (every live sequence) plus each request's reservation and holds."""
        self._pool.check_integrity()
        owned: dict[int, int] = {}
        seqs_list = list(seqs)
        tables = [s.block_table for s in seqs_list]
        for blocks in [*tables, *(list(r.blocks()) for r in self._requests.values())]:
            for b in blocks:
                owned[b] = owned.get(b, 0) + 1
        for b in range(self.num_blocks):
            rc = self._pool.ref_counts[b]
            assert rc == owned.get(b, 0), f"block {b}: ref {rc} but {owned.get(b, 0)} owners"
        if self._w is not None:
            self._w.check_integrity(
                seqs_list, [list(r.window_blocks()) for r in self._requests.values()]
            )
