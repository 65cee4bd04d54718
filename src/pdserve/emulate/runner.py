"""EmulatedRunner: the engine's `Runner` with the forward pass replaced by a timed step.

A step lasts `cost.step_time_s(batch, sampled) * time_scale` seconds of wall time (batch = the plan's
(start, new tokens) entries, as the simulator charges it). Back-to-back steps chain on their
deadlines (the engine's own Python work between two steps is part of the modelled per-step
overhead), so modelled time keeps pace with wall time while the engine is busy; what is left
over is the lag: sum(end - deadline), reported with the modelled time. A step that starts
more than `chain_gap_s` after the previous deadline starts late: when it continues a
sequence the previous step ran (the engine was busy, not idle), that late start is time the
engine lost between steps (a starved CPU, a long command) and is counted as the gap,
sum(start - previous deadline); the lag alone does not see it. A step with a prompt chunk
that starts `cost.cold_after_s` or more after the previous deadline also pays
`cost.cold_prompt_s` (a CPU profile's cold start; 0 otherwise), as the simulator charges it.

KV: per wire layer a numpy array [num_blocks, 2, block_size, 1, head_dim] (float16, a few
bytes per block). Each step writes, at every new token's slot, K = token % 2039 and
V = position % 2039 (exact in float16). The first time a sequence is stepped with a context it
did not compute here (admitted from a prefill, a kvstore prefix), that context is checked
against its tokens: a KV byte lost or misplaced on the way fails the step.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from pdserve.emulate.tokens import TokenHasher

_MOD = 2039  # prime < 2048: every value is exact in float16
KV_DTYPE = np.float16


class StepModel(Protocol):  # costmodel.costs.CostModel
    cold_prompt_s: float
    cold_after_s: float

    def step_time_s(self, batch: Sequence[tuple[int, int]], num_streamed: int) -> float: ...


class Clock(Protocol):
    def now(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


class KVMismatchError(RuntimeError):
    """An emulated sequence's context KV does not hold its tokens."""


class EmulatedRunner:
    def __init__(
        self,
        cost: StepModel,
        vocab_size: int,
        num_blocks: int,
        block_size: int,
        num_layers: int = 1,
        head_dim: int = 1,
        time_scale: float = 1.0,
        clock: Clock | None = None,
        chain_gap_s: float = 0.002,
    ) -> None:
        self.cost = cost
        self.block_size = block_size
        self.time_scale = time_scale
        self.clock = clock or WallClock()
        # two steps whose wall gap is below this (scaled) chain on their deadlines
        self.chain_gap_s = chain_gap_s * time_scale
        self.kv_caches = [
            np.zeros((num_blocks, 2, block_size, 1, head_dim), KV_DTYPE) for _ in range(num_layers)
        ]
        self.tokens = TokenHasher(vocab_size)
        self._checked: weakref.WeakSet[Any] = weakref.WeakSet()
        self._last_deadline = -1e18
        # modelled time and lag, in modelled seconds (wall / time_scale)
        self.steps = 0
        self.sequences = 0  # distinct sequences stepped here
        self.modelled_s = 0.0
        self.lag_s = 0.0
        self.max_lag_s = 0.0
        self.gap_s = 0.0  # lost between steps of a busy engine (see the module docstring)
        self._last_running: set[str] = set()  # request ids of the previous step

    # ---- the step -----------------------------------------------------------------------
    def execute(
        self, plan: Any, layer_callback: Callable[[int], None] | None = None
    ) -> dict[str, int]:
        t0 = self.clock.now()
        batch = [(e.start, e.num_new_tokens) for e in plan.scheduled]
        modelled = self.cost.step_time_s(batch, sum(1 for e in plan.scheduled if e.sample))
        late = t0 - self._last_deadline
        cold = late >= self.cost.cold_after_s * self.time_scale  # as the simulator charges it
        if cold and self.cost.cold_prompt_s and any(n > 1 for _, n in batch):
            modelled += self.cost.cold_prompt_s
        begin = self._last_deadline if 0 <= late < self.chain_gap_s else t0
        running = {e.seq.request_id for e in plan.scheduled}
        if late >= self.chain_gap_s and not running.isdisjoint(self._last_running):
            self.gap_s += late / self.time_scale
        self._last_running = running
        deadline = begin + modelled * self.time_scale
        sampled: dict[str, int] = {}
        for e in plan.scheduled:
            seq = e.seq
            if seq not in self._checked:
                self.sequences += 1
                if e.start > 0:
                    self._check_context(seq, e.start)
                self._checked.add(seq)
            self._write(seq, e.start, e.num_new_tokens)
            if e.sample:
                sampled[seq.request_id] = self.tokens.next_token(seq)
        left = deadline - self.clock.now()
        if left > 0:
            self.clock.sleep(left)
        if layer_callback is not None:  # the KV push starts when the step ends (as simulated)
            for layer in range(len(self.kv_caches)):
                layer_callback(layer)
        end = self.clock.now()
        self._last_deadline = deadline
        lag = max(0.0, end - deadline) / self.time_scale
        self.steps += 1
        self.modelled_s += modelled
        self.lag_s += lag
        self.max_lag_s = max(self.max_lag_s, lag)
        return sampled

    def counters(self) -> dict[str, float]:
        return {
            "emulate_steps": float(self.steps),
            "emulate_sequences": float(self.sequences),
            "emulate_modelled_s": self.modelled_s,
            "emulate_lag_s": self.lag_s,
            "emulate_max_lag_s": self.max_lag_s,
            "emulate_gap_s": self.gap_s,
        }

    # ---- KV content -----------------------------------------------------------------------
    def _slots(self, table: list[int], start: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        pos = np.arange(start, start + n)
        blocks = np.asarray(table, dtype=np.int64)[pos // self.block_size]
        return blocks, pos % self.block_size

    def _write(self, seq: Any, start: int, n: int) -> None:
        toks = np.asarray(seq.all_token_ids[start : start + n], dtype=np.int64)
        blocks, offs = self._slots(seq.block_table, start, n)
        k = (toks % _MOD).astype(KV_DTYPE)[:, None, None]
        v = (np.arange(start, start + n) % _MOD).astype(KV_DTYPE)[:, None, None]
        for cache in self.kv_caches:
            cache[blocks, 0, offs] = k
            cache[blocks, 1, offs] = v

    def _check_context(self, seq: Any, n: int) -> None:
        toks = np.asarray(seq.all_token_ids[:n], dtype=np.int64) % _MOD
        blocks, offs = self._slots(seq.block_table, 0, n)
        pos = np.arange(n) % _MOD
        for layer, cache in enumerate(self.kv_caches):
            k = cache[blocks, 0, offs, 0, 0].astype(np.int64)
            v = cache[blocks, 1, offs, 0, 0].astype(np.int64)
            bad = np.flatnonzero((k != toks) | (v != pos))
            if bad.size:
                raise KVMismatchError(
                    f"emulated KV of {seq.request_id} (layer {layer}) does not hold its "
                    f"context: {bad.size} of {n} positions differ, first at {int(bad[0])}"
                )

    # ---- KV import / export (block granularity) -------------------------------------------
    def empty_kv(self, shape: Sequence[int]) -> np.ndarray:
        return np.empty(tuple(shape), KV_DTYPE)

    def read_layer(self, layer: int, block_ids: list[int]) -> np.ndarray:
        return self.kv_caches[layer][np.asarray(block_ids, dtype=np.int64)]  # a copy

    def write_layer(self, layer: int, block_ids: list[int], kv: Any) -> None:
        cache = self.kv_caches[layer]
        kv = np.asarray(kv)
        if kv.shape[1:] != cache.shape[1:] or kv.shape[0] != len(block_ids):
            raise ValueError(
                f"kv shape {kv.shape} does not match {len(block_ids)} blocks of {cache.shape[1:]}"
            )
        cache[np.asarray(block_ids, dtype=np.int64)] = kv

    def read_blocks(self, block_ids: list[int]) -> np.ndarray:
        """[n, L, 2, block_size, 1, head_dim]."""
        return np.stack([self.read_layer(i, block_ids) for i in range(len(self.kv_caches))], 1)
