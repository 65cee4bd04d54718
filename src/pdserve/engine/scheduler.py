"""Scheduler: plans one engine step under a token budget. No tensors.

Each step: running requests first (decodes, then unfinished prefill chunks, oldest first),
then waiting requests FCFS while budget, max_num_seqs and free blocks allow. Long prompts are
chunked across steps. When blocks run out, the newest running request not yet planned this
step is preempted by recompute: its blocks are freed, num_computed_tokens goes back to 0 and it
returns to the front of the waiting queue keeping its generated tokens, so it resumes exactly.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.kv.block_pool import BlockPool
from pdserve.kv.hashing import block_hashes, root_hash


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # num_computed_tokens before this step (= position of the first new token)
    num_new_tokens: int
    sample: bool  # True when this step computes the sequence's last known token


@dataclass
class SchedulerPlan:
    scheduled: list[ScheduledSeq] = field(default_factory=list)  # decodes first
    preempted: list[str] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> dict[str, int]:
        return {s.seq.request_id: s.num_new_tokens for s in self.scheduled}

    @property
    def block_tables(self) -> dict[str, list[int]]:
        return {s.seq.request_id: list(s.seq.block_table) for s in self.scheduled}

    @property
    def total_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    def __bool__(self) -> bool:
        return bool(self.scheduled)


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        namespace: str,
    ) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.namespace = namespace
        self._root = root_hash(namespace)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- admission / removal ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Admit a sequence whose K/V is already in `seq.block_table` (decode side)."""
        seq.status = SeqStatus.RUNNING
        self.register_computed_blocks(seq)
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks (full computed blocks stay cached)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self._release(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- prefix cache -----------------------------------------------------------------
    def _hashes(self, seq: Sequence, n_blocks: int) -> list[bytes]:
        """Chained hashes of the first `n_blocks` full blocks of the sequence (memoised)."""
        have = len(seq.block_hashes)
        if have < n_blocks:
            parent = seq.block_hashes[-1] if have else self._root
            toks = seq.all_token_ids[have * self.block_size : n_blocks * self.block_size]
            seq.block_hashes.extend(block_hashes(toks, self.block_size, self.namespace, parent))
        return seq.block_hashes[:n_blocks]

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Publish the full blocks whose K/V is computed to the prefix cache."""
        n_full = min(seq.num_computed_tokens // self.block_size, len(seq.block_table))
        if n_full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, n_full)
        for i in range(seq.num_registered_blocks, n_full):
            self.pool.cache_block(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = n_full

    # ---- planning ---------------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        plan = SchedulerPlan()
        budget = self.max_num_batched_tokens
        planned: set[int] = set()  # id(seq) planned this step: never preemption victims
        decodes = [s for s in self.running if s.num_tokens - s.num_computed_tokens == 1]
        prefills = [s for s in self.running if s.num_tokens - s.num_computed_tokens > 1]
        for seq in decodes + prefills:
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if self._grow_or_preempt(seq, num_new, planned, plan):
                plan.scheduled.append(self._entry(seq, num_new))
                planned.add(id(seq))
                budget -= num_new
        if plan.preempted:  # memory is tight: admit nobody new this step
            return plan
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_new = self._admit(seq, budget)
            if num_new == 0:
                break
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.scheduled.append(self._entry(seq, num_new))
            budget -= num_new
        return plan

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, start, num_new, sample=start + num_new == seq.num_tokens)

    def _blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def _grow_or_preempt(
        self, seq: Sequence, num_new: int, planned: set[int], plan: SchedulerPlan
    ) -> bool:
        need = self._blocks_needed(seq, seq.num_computed_tokens + num_new)
        while need > self.pool.num_free_blocks:
            victims = [s for s in self.running if id(s) not in planned]
            victim = victims[-1]  # newest unplanned (seq itself is unplanned)
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is seq:
                return False
        seq.block_table.extend(self.pool.allocate(need))
        return True

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take prefix hits and blocks for a waiting sequence's first chunk. Returns the number
        of tokens planned (0 = does not fit now; nothing changed)."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        hits: list[int] = []
        max_hit_blocks = 0
        if self.pool.enable_prefix_caching:
            # always recompute at least the last token (it produces the next logits)
            max_hit_blocks = (seq.num_tokens - 1) // self.block_size
            hashes = self._hashes(seq, max_hit_blocks)
            hits = self.pool.find_prefix(hashes, record=False)
        hit_tokens = len(hits) * self.block_size
        num_new = min(seq.num_tokens - hit_tokens, budget)
        need = -(-(hit_tokens + num_new) // self.block_size) - len(hits)
        revived = sum(1 for b in hits if self.pool.ref_counts[b] == 0)
        if need + revived > self.pool.num_free_blocks:
            return 0
        self.pool.touch(hits)
        seq.block_table = hits + self.pool.allocate(need)
        seq.num_computed_tokens = hit_tokens
        seq.num_registered_blocks = len(hits)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit_tokens
            self.pool.record_lookup(max_hit_blocks, len(hits))
        return num_new

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release(self, seq: Sequence) -> None:
        self.register_computed_blocks(seq)
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    # ---- after the step ---------------------------------------------------------------
    def update(self, plan: SchedulerPlan, sampled: dict[str, int]) -> list[ScheduledSeq]:
        """Advance num_computed_tokens, append sampled tokens, publish full blocks.
        Returns the entries that produced a token (the engine checks stop conditions)."""
        produced = []
        for entry in plan.scheduled:
            seq = entry.seq
            seq.num_computed_tokens = entry.start + entry.num_new_tokens
            if entry.sample:
                seq.output_token_ids.append(sampled[seq.request_id])
                produced.append(entry)
            self.register_computed_blocks(seq)
        return produced

    def iter_all(self) -> Iterable[Sequence]:
        yield from self.running
        yield from self.waiting
