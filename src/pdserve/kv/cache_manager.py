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

`release(request_id)` drops every piece of a request's side state; it is idempotent, so a
caller that lost track (cancelled, timed out, aborted twice) can always call it again.
`check_integrity` proves that every block's ref count equals its owners.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.errors import InvalidRequestError, OverloadedError
from pdserve.kv.block_pool import BlockPool, PrefixCacheStats
from pdserve.kv.hashing import block_hashes, root_hash


class SeqBlocks(Protocol):
    """What the manager needs of a sequence (engine.sequence.Sequence)."""

    request_id: str
    block_table: list[int]
    block_hashes: list[bytes]
    num_computed_tokens: int
    num_registered_blocks: int

    @property
    def all_token_ids(self) -> list[int]: ...


@dataclass
class RequestKV:
    """Block state a request id owns outside a running sequence's block table."""

    reserved: list[int] = field(default_factory=list)
    prefix_hold: list[int] = field(default_factory=list)
    finished_hold: list[int] = field(default_factory=list)
    hold_on_finish: bool = False

    def __bool__(self) -> bool:
        return bool(self.reserved or self.prefix_hold or self.finished_hold or self.hold_on_finish)

    def blocks(self) -> Iterable[int]:
        yield from self.reserved
        yield from self.prefix_hold
        yield from self.finished_hold


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, kv_fingerprint: str
    ) -> None:
        self._pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
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

    def reserved_blocks(self, request_id: str) -> list[int]:
        state = self._requests.get(request_id)
        return list(state.reserved) if state else []

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
        have = len(seq.block_hashes)
        if have < n_blocks:
            parent = seq.block_hashes[-1] if have else self._root
            toks = seq.all_token_ids[have * self.block_size : n_blocks * self.block_size]
            seq.block_hashes.extend(
                block_hashes(toks, self.block_size, self.kv_fingerprint, parent)
            )
        return seq.block_hashes[:n_blocks]

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest locally cached prefix of `hashes` (no refs taken)."""
        return self._pool.find_prefix(hashes, record=False)

    def cached_run(self, hashes: Sequence[bytes], skip: int) -> list[int]:
        """Block ids of `hashes[skip:]` cached here, up to the first miss (no refs taken).
        A block's hash names its content whatever is cached before it, so the run may start
        past blocks this pool never registered (a decode's trimmed sliding-window prefix)."""
        out: list[int] = []
        for h in hashes[skip:]:
            b = self._pool.lookup(h)
            if b is None:
                break
            out.append(b)
        return out

    def register_computed(self, seq: SeqBlocks) -> None:
        """Publish the full blocks of `seq` whose K/V is computed to the prefix cache."""
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if n_full <= seq.num_registered_blocks:
            return
        hashes = self.seq_hashes(seq, n_full)
        for i in range(seq.num_registered_blocks, n_full):
            self._pool.cache_block(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = n_full

    # ---- running sequences -----------------------------------------------------------
    def allocate_first_chunk(self, seq: SeqBlocks, budget: int, record: bool) -> int:
        """Give a waiting `seq` its prefix hits and blocks for its first chunk of at most
        `budget` new tokens. Returns the tokens to compute (0 = does not fit; nothing changed).
        Once placed, the request's prefix hold (if any) is dropped: the sequence holds it."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        num_tokens = len(seq.all_token_ids)
        hits: list[int] = []
        max_hit_blocks = 0
        if self.enable_prefix_caching:
            # always recompute at least the last token (it produces the next logits)
            max_hit_blocks = (num_tokens - 1) // self.block_size
            hits = self._pool.find_prefix(self.seq_hashes(seq, max_hit_blocks), record=False)
        hit_tokens = len(hits) * self.block_size
        num_new = min(num_tokens - hit_tokens, budget)
        need = self.blocks_for(hit_tokens + num_new) - len(hits)
        revived = sum(1 for b in hits if self._pool.ref_counts[b] == 0)
        if need + revived > self._pool.num_free_blocks:
            return 0
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
        """Extend `seq`'s table to hold `num_tokens` tokens (caller checked the room)."""
        seq.block_table.extend(self._pool.allocate(self.blocks_to_grow(seq, num_tokens)))

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
        self._pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0
        self._tidy(seq.request_id)

    # ---- decode reservations ---------------------------------------------------------
    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Reserve blocks for `num_tokens` tokens of a request whose KV arrives from elsewhere.
        Registered under `request_id` before returning, so `release(request_id)` frees them
        whatever happens to the caller."""
        state = self._requests.get(request_id)
        if state is not None and state.reserved:
            raise InvalidRequestError("request_id", f"{request_id!r} already has a reservation")
        n = self.blocks_for(num_tokens)
        if n > self._pool.num_free_blocks:
            raise OverloadedError(f"need {n} KV blocks, {self._pool.num_free_blocks} free")
        blocks = self._pool.allocate(n)
        self._state(request_id).reserved = blocks
        return list(blocks)

    def claim_reservation(self, request_id: str) -> list[int]:
        """Hand a reservation's blocks to the sequence being admitted (they leave the
        reservation; the sequence frees them). [] when there is none."""
        state = self._requests.get(request_id)
        if state is None or not state.reserved:
            return []
        blocks, state.reserved = state.reserved, []
        self._tidy(request_id)
        return blocks

    # ---- holds -----------------------------------------------------------------------
    def hold_prefix(self, request_id: str, hashes: Sequence[bytes]) -> int:
        """Hold the longest locally cached prefix of `hashes` until `request_id` is scheduled
        (or released). Returns the blocks held."""
        blocks = self._pool.find_prefix(hashes, record=False)
        self._pool.touch(blocks)
        self._state(request_id).prefix_hold.extend(blocks)
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
        return n

    # ---- import / read -----------------------------------------------------------------
    def import_blocks(
        self, hashes: Sequence[bytes], write: Callable[[list[int], list[int]], None]
    ) -> int:
        """Insert blocks fetched from elsewhere into the prefix cache. `write(block_ids,
        indices)` copies data[indices] into block_ids. Already-cached hashes are skipped; the
        new blocks stay free and cached. Returns the number inserted."""
        if not self.enable_prefix_caching:
            return 0
        todo = [i for i, h in enumerate(hashes) if self._pool.lookup(h) is None]
        todo = todo[: self._pool.num_free_blocks]
        if not todo:
            return 0
        blocks = self._pool.allocate(len(todo))
        write(blocks, todo)
        for b, i in zip(blocks, todo, strict=True):
            self._pool.cache_block(b, hashes[i])
        self._pool.free(blocks)
        return len(todo)

    # ---- checks ----------------------------------------------------------------------
    def check_integrity(self, seqs: Iterable[SeqBlocks]) -> None:
        """Raise AssertionError unless every block's ref count equals its owners: the block
        tables of `seqs` (every live sequence) plus each request's reservation and holds."""
        self._pool.check_integrity()
        owned: dict[int, int] = {}
        tables = [s.block_table for s in seqs]
        for blocks in [*tables, *(list(r.blocks()) for r in self._requests.values())]:
            for b in blocks:
                owned[b] = owned.get(b, 0) + 1
        for b in range(self.num_blocks):
            rc = self._pool.ref_counts[b]
            assert rc == owned.get(b, 0), f"block {b}: ref {rc} but {owned.get(b, 0)} owners"
