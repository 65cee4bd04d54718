"""One simulated worker: the real engine `Scheduler` and `BlockPool`, stepped in simulated
time with step costs from a `CostModel` instead of a model forward.

What this adapter re-states from `LLMEngine` (small, torch-bound there): the finish rule
(prefill-only requests finish after their first token; others at max_tokens or the context
limit, with ignore_eos as every benchmark request has), the decode side's block reservation
(`KVCacheManager.reserve(prompt + 1)`) and the admission of a prefilled request
(`claim_reservation`: the reserved blocks become the sequence's, token 0 already sampled
elsewhere). The scheduling (batching, chunking, prefix hits, preemption by recompute) and
every block reference (`KVCacheManager` over `BlockPool`) are the engine's own code.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from operator import attrgetter, mul
from typing import Any

from pdserve.costmodel.costs import CostModel
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduler import ScheduledSeq, Scheduler, SchedulerPlan
from pdserve.engine.sequence import Sequence as Seq
from pdserve.errors import OverloadedError
from pdserve.kv.cache_manager import KVCacheManager
from pdserve.load import LoadReport

_START = attrgetter("start")
_NEW = attrgetter("num_new_tokens")
_SAMPLE = attrgetter("sample")

SAMPLED_TOKEN = 11  # every simulated sample; lengths are fixed by max_tokens (ignore_eos)


@dataclass
class InstanceConfig:
    num_blocks: int = 4096
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    chunked_prefill: bool = True  # False: vLLM <= 0.3 (prefill priority, whole prompts)
    enable_prefix_caching: bool = True
    max_model_len: int = 1 << 30
    namespace: str = "sim"
    window: int | None = None  # sliding layers in a window pool of `window_blocks` (Gemma 4)
    window_blocks: int | None = None


@dataclass(eq=False)
class SimSeq(Seq):
    """An engine `Sequence` that carries what the simulator reads on each of its tokens (no
    map lookups on the hot path): its finish rule, as the output count at which it finishes,
    and the caller's per-request object (the cluster's `RequestRecord`)."""

    finish_at: int = 0
    record: Any = None


@dataclass
class StepResult:
    produced: list[tuple[Seq, str | None]] = field(default_factory=list)  # (seq, finish reason)


# Prompt -> its full blocks' chained hashes, per (block size, KV fingerprint): a prompt is
# hashed once per process, not once per instance it visits in every simulated run (a plan
# replays the same trace requests at many rates). Keyed by the prompt list's id; the entry
# keeps the list alive, so the id cannot be reused while it is cached.
_PROMPT_HASHES: dict[tuple[int, int, str], tuple[Sequence[int], list[bytes]]] = {}
_PROMPT_HASHES_MAX = 30_000  # cleared when full (bounds its memory)


def _no_bytes(_blocks: list[int], _indices: list[int]) -> None:
    """A block write with no bytes to copy (the simulator moves none)."""


class SimInstance:
    def __init__(self, instance_id: str, role: int, costs: CostModel, config: InstanceConfig):
        self.instance_id = instance_id
        self.role = role
        self.costs = costs
        self.config = config
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.namespace,
            config.window,
            config.window_blocks,
        )
        self.scheduler = Scheduler(
            self.kv, config.max_num_batched_tokens, config.max_num_seqs, config.chunked_prefill
        )
        self.busy = False  # a step is in flight
        # when the step in flight ends (engine commands wait for it), else the last one ended
        self.step_end = -math.inf  # none yet: the first step is a cold one
        # a step on a shared host (`SimCluster._retime`): its plan, start, seconds of work
        # left at rate 1, the rate it runs at, when work_left was last brought up to date,
        # and the number of its currently scheduled end
        self.step_plan: Any = None
        self.step_started = 0.0
        self.work_left = 0.0
        self.step_rate = 0.0
        self.step_marked = 0.0
        self.step_gen = 0
        self.tokens_in_flight = 0  # prompt tokens of requests in flight (worker's own count)
        self.busy_s = 0.0
        # with `track_engine`: the seconds of its steps that were engine work (a step's
        # duration x its engine-only share), what the worker's `engine_step_seconds` counts
        self.track_engine = False
        self.engine_s = 0.0
        self._engine_share = 1.0
        self.flip_to = 0  # role this instance drains towards (the flip controller's pick)
        self.steps = 0
        self._arrival = itertools.count()

    # ---- requests ---------------------------------------------------------------------
    def add(
        self, request_id: str, prompt: Sequence[int], max_tokens: int, prefill_only: bool
    ) -> SimSeq:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = SimSeq(
            request_id, list(prompt), params, next(self._arrival), prefill_only=prefill_only
        )
        seq.block_hashes = self._prompt_hashes(prompt)
        self._track(seq)
        self.scheduler.add(seq)
        return seq

    def _prompt_hashes(self, prompt: Sequence[int]) -> list[bytes]:
        """A fresh copy of the hashes `KVCacheManager.seq_hashes` memoises on a sequence of
        this prompt (the same function, the same chain), from the process-wide cache."""
        key = (id(prompt), self.kv.block_size, self.kv.kv_fingerprint)
        hit = _PROMPT_HASHES.get(key)
        if hit is None or hit[0] is not prompt:
            if len(_PROMPT_HASHES) >= _PROMPT_HASHES_MAX:
                _PROMPT_HASHES.clear()
            hit = (prompt, self.kv.compute_block_hashes(prompt))
            _PROMPT_HASHES[key] = hit
        return list(hit[1])  # seq_hashes extends the sequence's list in place

    def hashes(self, prompt: Sequence[int]) -> list[bytes]:
        return self.kv.compute_block_hashes(prompt)

    def cached_prefix_blocks(self, hashes: Sequence[bytes]) -> int:
        return len(self.kv.cached_prefix(hashes))

    def reserve(self, request_id: str, num_tokens: int, num_kv_tokens: int = 0) -> bool:
        """`KVCacheManager.reserve` as the decode worker calls it (the KV of the first
        `num_kv_tokens` tokens arrives, trimmed to a window group's window): False (the
        worker's RESOURCE_EXHAUSTED) when the blocks are not free."""
        try:
            self.kv.reserve(request_id, num_tokens, num_kv_tokens)
        except OverloadedError:
            return False
        return True

    def has_reservation(self, request_id: str) -> bool:
        return bool(self.kv.reserved_blocks(request_id))

    def unreserve(self, request_id: str) -> None:
        self.kv.release(request_id)

    def add_prefilled(
        self, request_id: str, prompt: Sequence[int], first_token: int, max_tokens: int
    ) -> SimSeq:
        """`LLMEngine.add_prefilled_request`: the reservation becomes the sequence's blocks."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        seq = SimSeq(request_id, list(prompt), params, next(self._arrival))
        seq.block_hashes = self._prompt_hashes(prompt)
        seq.output_token_ids.append(first_token)
        seq.num_computed_tokens = len(prompt)
        if self.kv.window is not None:  # the window entries whose KV did not travel: NULL
            self.kv.admit_reservation(seq, len(prompt))
        else:
            seq.block_table = self.kv.claim_reservation(request_id)
            if self.costs.kv_window:  # a layered model in one pool: the blocks whose sliding
                # layers did not travel are never offered as cached prefix (as the engine)
                seq.num_registered_blocks = (
                    max(0, len(prompt) - self.costs.kv_window) // self.config.block_size
                )
        self._track(seq)
        self.scheduler.add_running(seq)
        return seq

    def import_cached(self, hashes: Sequence[bytes], window_from: int = 0) -> int:
        """A kvstore fetch as the worker lands it: `import_blocks` (no bytes to write here)
        into the prefix cache (a layered fetch: window layers from `window_from` on); the
        caller then holds the prefix until the request runs."""
        return self.kv.import_blocks(hashes, _no_bytes, _no_bytes, window_from)

    # ---- steps ------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_unfinished()

    def plan(self, cold: bool = False) -> tuple[SchedulerPlan, float] | None:
        """The next step and its seconds; `cold`: the instance stepped nothing for at least
        `costs.cold_after_s`, so a step with a prompt chunk pays `costs.cold_prompt_s`."""
        plan = self.scheduler.schedule()
        if not plan:
            return None
        # `plan_features` of the plan's (start, new) entries and the sequences it samples,
        # in C-level passes. Every term plan_features adds in floats is an integer (the
        # pairs term n * (s + (n + 1) / 2) = n * s + n (n + 1) / 2) below 2 ** 53, so each
        # partial float sum is exact: the float of the integer sum is the same value
        sched = plan.scheduled
        starts = list(map(_START, sched))
        news = list(map(_NEW, sched))
        new = sum(news)
        ctx = sum(starts) + new
        pairs = sum(map(mul, news, starts)) + (sum(map(mul, news, news)) + new) // 2
        features = (1.0, float(new), float(len(sched)), float(ctx), float(pairs))
        streamed = sum(map(_SAMPLE, sched))
        if getattr(self.costs.step, "needs_batch", False):  # a form that reads the entries
            return plan, self.costs.step_time_s(list(zip(starts, news, strict=True)), streamed)
        if self.costs.serves_prefill_extra:  # a profile of a CPU engine (see CostModel)
            chunks = [n for n in news if n > 1]
            dur = self.costs.step_time_features_s(features, streamed, len(chunks), sum(chunks))
        else:
            dur = self.costs.step_time_features_s(features, streamed)
        engine_s = float(self.costs.step.features_s(features)) if self.track_engine else 0.0
        if cold and self.costs.cold_prompt_s and new > len(news):  # a chunk of > 1 token
            dur += self.costs.cold_prompt_s  # engine time: the step itself runs slower
            engine_s += self.costs.cold_prompt_s
        if self.track_engine and dur > 0:
            self._engine_share = engine_s / dur
        return plan, dur

    def finish_step(self, plan: SchedulerPlan, duration_s: float) -> StepResult:
        out = StepResult()
        produced = out.produced
        for entry in self.advance(plan, duration_s):
            seq = entry.seq
            assert isinstance(seq, SimSeq)
            if len(seq.output_token_ids) < seq.finish_at:
                produced.append((seq, None))
            else:
                produced.append((seq, self.finish(seq)))
        return out

    def advance(self, plan: SchedulerPlan, duration_s: float) -> list[ScheduledSeq]:
        """The step ended: `Scheduler.update` (every sampled token is SAMPLED_TOKEN). Returns
        the entries that produced a token; the caller finishes (`finish`) each whose output
        count reached its `finish_at`."""
        self.busy_s += duration_s
        self.steps += 1
        if self.track_engine:
            self.engine_s += duration_s * self._engine_share
        return self.scheduler.update(plan, SAMPLED_TOKEN)

    def finish(self, seq: Seq) -> str:
        """Finish `seq` (its output reached `finish_at`); returns the finish reason."""
        reason = "prefill_done" if seq.prefill_only else "length"
        self.scheduler.finish(seq, reason)
        return reason

    def _track(self, seq: SimSeq) -> None:
        """The finish rule, as the output count at which `seq` finishes: a prefill-only
        request after token 0; others at max_tokens or when prompt + output reach the
        context limit (n_out >= max_tokens or prompt + n_out >= max_len)."""
        if seq.prefill_only:
            seq.finish_at = 0
        else:
            room = self.config.max_model_len - len(seq.prompt_token_ids)
            seq.finish_at = min(seq.params.max_tokens, room)

    def load(self) -> LoadReport:
        return LoadReport(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            free_blocks=self.kv.num_free_blocks,
            total_blocks=self.config.num_blocks,
            tokens_in_flight=self.tokens_in_flight,
            num_reserved=self.kv.num_reservations,
        )
