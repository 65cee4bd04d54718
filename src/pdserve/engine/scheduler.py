"""Scheduler: plans one engine step under a token budget. No tensors.

Each step: running requests first (decodes, then unfinished prefill chunks, oldest first),
then waiting requests FCFS while budget, max_num_seqs and free blocks allow. Long prompts are
chunked across steps. When blocks run out, the newest running request not yet planned this
step is preempted by recompute: its blocks are freed, num_computed_tokens goes back to 0 and it
returns to the front of the waiting queue keeping its generated tokens, so it resumes exactly.
With a sliding window group (KVCacheManager), every check counts both pools, and after each
step a sequence's window blocks that left the window are freed (`trim_window`).

`chunked_prefill=False` is vLLM <= 0.3's scheduler (prefill priority, no chunking): a step
either prefills or decodes. While a waiting prompt can start, the step is a prefill step of
whole prompts (FCFS, as many as fit in max_num_batched_tokens; the first one always goes
whole) and the running decodes wait; otherwise it is a decode step of every running request.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from pdserve.engine.sequence import SeqStatus, Sequence
from pdserve.kv.cache_manager import KVCacheManager


@dataclass(slots=True)
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
    """Plans steps; every block it gives or takes goes through the KVCacheManager."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        chunked_prefill: bool = True,
    ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.chunked_prefill = chunked_prefill
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ---- admission / removal ----------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """Add a sequence whose K/V is already in `seq.block_table` (decode side)."""
        seq.status = SeqStatus.RUNNING
        self.kv.register_computed(seq)
        self.running.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Mark finished and release its blocks (full computed blocks stay cached; kept held
        for a publish when its request asked for it and it was not aborted)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.kv.free(seq, finished=reason != "abort")

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- planning ---------------------------------------------------------------------
    def schedule(self) -> SchedulerPlan:
        plan = SchedulerPlan()
        if not self.chunked_prefill:  # prefill priority: a prefill step if any prompt starts
            self._admit(plan, self.max_num_batched_tokens, whole=True)
            if not plan:  # a decode step: every running request (max_num_seqs bounds them)
                self._plan_running(plan, max(self.max_num_batched_tokens, len(self.running)))
            return plan
        budget = self._plan_running(plan, self.max_num_batched_tokens)
        if not plan.preempted:  # memory is tight: start nobody new this step
            self._admit(plan, budget, whole=False)
        return plan

    def _plan_running(self, plan: SchedulerPlan, budget: int) -> int:
        """Running requests (decodes first, then unfinished prefill chunks); the budget left.
        `plan` is empty when this starts, so the sequences it schedules are the ones planned
        this step (never preemption victims). The hot path of every step: decodes are planned
        in the one pass that finds the prefill chunks, and a decode whose last block has room
        takes no KV call."""
        prefills: list[tuple[Sequence, int]] = []
        bs = self.kv.block_size
        scheduled = plan.scheduled
        running = SeqStatus.RUNNING
        # a copy: a preemption removes its victim from self.running. A sequence's `left` is
        # that of the step's start: only preempted sequences change during this loop
        for seq in tuple(self.running):
            if seq.status is not running:  # preempted earlier in this loop
                continue
            left = len(seq.prompt_token_ids) + len(seq.output_token_ids) - seq.num_computed_tokens
            if left != 1:  # a prefill chunk (planned after every decode) or nothing to do
                if left > 1:
                    prefills.append((seq, left))
                continue
            if budget <= 0:
                return budget
            start = seq.num_computed_tokens
            # blocks beyond its table (KVCacheManager.blocks_to_grow): none on most decodes
            if -(-(start + 1) // bs) > len(seq.block_table) and not self._grow_or_preempt(
                seq, start + 1, plan
            ):
                continue
            scheduled.append(ScheduledSeq(seq, start, 1, True))
            budget -= 1
        for seq, left in prefills:
            if budget <= 0:
                break
            if seq.status is not running:
                continue
            num_new = left if left < budget else budget
            start = seq.num_computed_tokens
            target = start + num_new
            if -(-target // bs) > len(seq.block_table) and not self._grow_or_preempt(
                seq, target, plan
            ):
                continue
            scheduled.append(ScheduledSeq(seq, start, num_new, num_new == left))
            budget -= num_new
        return budget

    def _admit(self, plan: SchedulerPlan, budget: int, whole: bool) -> None:
        """Start waiting requests FCFS; `whole`: whole prompts only (no chunking)."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if whole and plan.scheduled and seq.num_tokens > budget:
                break
            chunk = max(budget, seq.num_tokens) if whole else budget
            num_new = self.kv.allocate_first_chunk(seq, chunk, record=seq.num_preemptions == 0)
            if num_new == 0:
                break
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            plan.scheduled.append(self._entry(seq, num_new))
            budget -= num_new

    def _entry(self, seq: Sequence, num_new: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        return ScheduledSeq(seq, start, num_new, sample=start + num_new == seq.num_tokens)

    def _grow_or_preempt(self, seq: Sequence, target: int, plan: SchedulerPlan) -> bool:
        """Grow `seq`'s tables to `target` tokens, preempting the newest running requests not
        planned this step while the blocks are not free. False: `seq` itself was preempted."""
        need = self.kv.blocks_to_grow(seq, target)  # seq's own need: preempting others keeps it
        if not need:
            return True
        planned: set[int] | None = None  # id(seq) planned this step: never preemption victims
        while not self.kv.has_room(need):  # both pools (a window group grows alike)
            if planned is None:
                planned = {id(e.seq) for e in plan.scheduled}
            victims = [s for s in self.running if id(s) not in planned]
            victim = victims[-1]  # newest unplanned (seq itself is unplanned)
            self._preempt(victim)
            plan.preempted.append(victim.request_id)
            if victim is seq:
                return False
        self.kv.grow(seq, target)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    # ---- after the step ---------------------------------------------------------------
    def update(self, plan: SchedulerPlan, sampled: Mapping[str, int] | int) -> list[ScheduledSeq]:
        """Advance num_computed_tokens, append sampled tokens (`sampled`: request id -> token,
        or one token for every sequence, as the simulator samples), publish full blocks.
        Returns the entries that produced a token (the engine checks stop conditions)."""
        kv = self.kv
        bs = kv.block_size
        register = kv.register_computed
        trim = kv.trim_window if kv.window is not None else None  # no window group: no trim
        one = sampled if isinstance(sampled, int) else None
        tokens: Mapping[str, int] = {} if isinstance(sampled, int) else sampled
        produced = []
        for entry in plan.scheduled:
            seq = entry.seq
            computed = seq.num_computed_tokens = entry.start + entry.num_new_tokens
            if entry.sample:
                seq.output_token_ids.append(tokens[seq.request_id] if one is None else one)
                produced.append(entry)
            if computed // bs > seq.num_registered_blocks:  # else register_computed is a no-op
                register(seq)
            if trim is not None:
                trim(seq)  # after registering: freed window blocks stay cached
        return produced

    def iter_all(self) -> Iterable[Sequence]:
        yield from self.running
        yield from self.waiting
