"""Cost models the simulator charges for work it does not run: engine steps, KV transfer,
kvstore fetches, router overhead. Fitted from a profile (`pdserve profile`) or built from a
hardware roofline (`pdserve.costmodel.roofline`).

Engine step (one scheduler plan, any mix of prefill chunks and decodes; plus
`stream_token_s` per sequence the step samples, see CostModel):
    step_s = base_s + per_token_s * new_tokens + per_seq_s * num_seqs
             + per_ctx_token_s * context_tokens + per_attn_s * attention_pairs
with new_tokens = sum of the plan's new tokens, context_tokens = sum of (start + new) over the
scheduled sequences (the KV each reads), attention_pairs = sum of new * (start + (new + 1) / 2)
(query x key pairs of causal attention over the chunk). The fit is least squares with every
coefficient kept >= 0 (an active-set loop over numpy's lstsq).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

FEATURES = ("const", "new_tokens", "num_seqs", "context_tokens", "attention_pairs")


def plan_features(batch: Iterable[tuple[int, int]]) -> tuple[float, float, float, float, float]:
    """(1, new tokens, sequences, context tokens, attention pairs) of a batch of
    (start, num_new) entries."""
    new = seqs = ctx = pairs = 0.0
    for start, num_new in batch:
        new += num_new
        seqs += 1
        ctx += start + num_new
        pairs += num_new * (start + (num_new + 1) / 2.0)
    return (1.0, new, seqs, ctx, pairs)


@dataclass
class StepCost:
    base_s: float = 0.0
    per_token_s: float = 0.0
    per_seq_s: float = 0.0
    per_ctx_token_s: float = 0.0
    per_attn_s: float = 0.0
    fit_rel_rmse: float | None = None  # relative RMS error of the fit on its samples

    def coefs(self) -> np.ndarray:
        return np.array(
            [self.base_s, self.per_token_s, self.per_seq_s, self.per_ctx_token_s, self.per_attn_s]
        )

    def step_s(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        return self.features_s(plan_features(batch))

    def features_s(self, features: tuple[float, float, float, float, float]) -> float:
        """A non-empty step from its `plan_features`."""
        return float(np.dot(self.coefs(), features))

    def scaled(self, factor: float) -> StepCost:
        c = self.coefs() * factor
        return StepCost(*c.tolist(), fit_rel_rmse=self.fit_rel_rmse)

    @classmethod
    def fit(
        cls, batches: Sequence[Sequence[tuple[int, int]]], times_s: Sequence[float]
    ) -> StepCost:
        """Non-negative least squares of step time on the features, weighted by 1/time so
        that short decode steps count as much as long prefills (relative error)."""
        x = np.array([plan_features(b) for b in batches], dtype=float)
        y = np.asarray(times_s, dtype=float)
        if len(y) == 0:
            raise ValueError("no samples to fit")
        w = 1.0 / np.maximum(y, 1e-6)
        active = list(range(x.shape[1]))
        coef = np.zeros(x.shape[1])
        while active:
            sol, *_ = np.linalg.lstsq(x[:, active] * w[:, None], y * w, rcond=None)
            if (sol >= 0).all():
                coef[:] = 0.0
                coef[active] = sol
                break
            active.pop(int(np.argmin(sol)))  # drop the most negative term and refit
        pred = x @ coef
        rel = float(np.sqrt(np.mean(((pred - y) / np.maximum(y, 1e-9)) ** 2)))
        return cls(*coef.tolist(), fit_rel_rmse=rel)

    @classmethod
    def fit_floor(
        cls,
        batches: Sequence[Sequence[tuple[int, int]]],
        times_s: Sequence[float],
        slack: float = 1.15,
        rounds: int = 4,
        keep_at_least: float = 0.3,
    ) -> StepCost:
        """The lower envelope: on a shared machine other processes only ever slow a step
        down, so refit on the samples at most `slack` x the current fit (a few rounds, never
        fewer than `keep_at_least` of them). The uncontended cost of a step."""
        idx = np.arange(len(times_s))
        fit = cls.fit(batches, times_s)
        y = np.asarray(times_s, dtype=float)
        for _ in range(rounds):
            pred = np.array([fit.step_s(batches[i]) for i in range(len(y))])
            keep = idx[y <= slack * pred]
            if len(keep) < max(8, keep_at_least * len(y)):
                keep = idx[np.argsort(y / np.maximum(pred, 1e-9))][
                    : max(8, int(keep_at_least * len(y)))
                ]
            fit = cls.fit([batches[i] for i in keep], y[keep])
        return fit


@dataclass
class KindScaledStep:
    """A step model x a factor that depends on what the step computes: `prefill` for a step
    with a prompt chunk (new tokens > sequences: compute-bound on a CPU), `decode` for a
    step of decodes only (memory-bound). Another process on the machine slows the two
    differently (`pdserve.sim.probe` measures both); one factor for both over- or
    under-charges the kind the probe did not see."""

    inner: Any  # StepCost (or any object with features_s)
    prefill: float = 1.0
    decode: float = 1.0

    def step_s(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        return self.features_s(plan_features(batch))

    def features_s(self, features: tuple[float, float, float, float, float]) -> float:
        factor = self.prefill if features[1] > features[2] else self.decode
        return float(self.inner.features_s(features)) * factor


@dataclass
class LinkCost:
    """Time to move n bytes: latency_s + n / bandwidth_Bps (0 bytes: free)."""

    latency_s: float = 0.0
    bandwidth_Bps: float = math.inf

    def time_s(self, nbytes: float) -> float:
        if nbytes <= 0:
            return 0.0
        return self.latency_s + nbytes / self.bandwidth_Bps

    @classmethod
    def fit(cls, sizes: Sequence[float], times_s: Sequence[float]) -> LinkCost:
        a = np.vstack([np.ones(len(sizes)), np.asarray(sizes, dtype=float)]).T
        (lat, inv_bw), *_ = np.linalg.lstsq(a, np.asarray(times_s, dtype=float), rcond=None)
        lat = max(0.0, float(lat))
        if inv_bw <= 0:  # flat: bandwidth beyond what the sizes can show
            return cls(float(np.min(times_s)), math.inf)
        return cls(lat, 1.0 / float(inv_bw))


@dataclass
class CostModel:
    """Everything the simulator charges; one per instance kind (pools may differ)."""

    step: StepCost = field(default_factory=StepCost)  # or any object with step_s, features_s
    transfer: LinkCost = field(default_factory=LinkCost)  # prefill -> decode KV push
    kvstore_fetch: LinkCost = field(default_factory=LinkCost)
    kvstore_publish: LinkCost = field(default_factory=LinkCost)
    router_overhead_s: float = 0.0  # per request, before placement (added to TTFT)
    token_overhead_s: float = 0.0  # per streamed message (gRPC relay of one token)
    # The serving stack's work for one token of one stream, on the engine's machine (the
    # engine thread's emit, the worker's and the router's relay, their gRPC): charged per
    # sampled sequence per step, as it shares the CPU with the step (measured by `pdserve
    # profile`: served TPOT minus the engine-only step, per stream; 0 for a GPU engine
    # whose host work overlaps its kernels)
    stream_token_s: float = 0.0
    # The same for a prompt: the serving stack's extra work per prefill chunk and per prompt
    # token of a step (a chunk = a scheduled entry of more than one new token), on top of the
    # engine-only step (`pdserve profile`: a served prompt's prefill stage minus the
    # engine-only step, fitted over prompt lengths; 0 for a GPU engine)
    prefill_chunk_s: float = 0.0
    prefill_token_s: float = 0.0
    kv_bytes_per_token: int = 0  # every stored layer, every block (a one-pool cache)
    # The sliding layers' share of it when the engine keeps them in a window pool (Gemma 4:
    # kv.footprint.window_group_split), and their window in tokens; 0 = one pool
    kv_window: int = 0
    kv_window_bytes_per_token: int = 0
    name: str = ""
    kv_capacity_bytes: int | None = None  # KV cache per instance (None: the worker default)
    devices: int = 1  # accelerators one instance occupies (tensor parallel degree)
    # A step's cost x this while another instance of the cluster is stepping: instances
    # that share one host's cores and memory (a CPU engine: the prefill and the decode of a
    # 1P1D on one machine slow each other, and their serving work has no spare core).
    # `pdserve profile` measures it per role on a served 1P1D; 1.0 for accelerators.
    neighbour_busy_factor: float = 1.0

    def step_time_s(self, batch: Sequence[tuple[int, int]], num_streamed: int) -> float:
        """One engine step of `batch` that samples `num_streamed` sequences."""
        if not batch:
            return 0.0
        t = self.step.step_s(batch) + self.stream_token_s * num_streamed
        if self.serves_prefill_extra:
            chunks = [n for _, n in batch if n > 1]
            t += self.prefill_chunk_s * len(chunks) + self.prefill_token_s * sum(chunks)
        return t

    def step_time_features_s(
        self,
        features: tuple[float, float, float, float, float],
        num_streamed: int,
        prefill_chunks: int = 0,
        prefill_tokens: int = 0,
    ) -> float:
        """`step_time_s` from a non-empty batch's `plan_features` (the simulator's hot path
        computes them while it walks the plan) and its prefill chunks and their tokens; the
        same float operations."""
        t = self.step.features_s(features) + self.stream_token_s * num_streamed
        if self.serves_prefill_extra:
            t += self.prefill_chunk_s * prefill_chunks + self.prefill_token_s * prefill_tokens
        return t

    @property
    def serves_prefill_extra(self) -> bool:
        """Whether a step's prefill chunks cost more than the engine-only step."""
        return bool(self.prefill_chunk_s or self.prefill_token_s)

    def transfer_bytes(self, num_tokens: int, block_size: int) -> int:
        """KV bytes a prefill pushes for a `num_tokens` prompt (kv.footprint stage
        "transfer"): every block of the main pool's layers, the sliding layers' last window."""
        nb = -(-num_tokens // block_size)
        full = nb * block_size * (self.kv_bytes_per_token - self.kv_window_bytes_per_token)
        if not self.kv_window:
            return full
        win_blocks = nb - max(0, num_tokens - self.kv_window) // block_size
        return full + win_blocks * block_size * self.kv_window_bytes_per_token

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("transfer", "kvstore_fetch", "kvstore_publish"):
            if math.isinf(d[k]["bandwidth_Bps"]):
                d[k]["bandwidth_Bps"] = None
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> CostModel:
        def link(x: dict[str, Any] | None) -> LinkCost:
            x = x or {}
            bw = x.get("bandwidth_Bps")
            return LinkCost(float(x.get("latency_s", 0.0)), math.inf if bw is None else float(bw))

        step = {k: v for k, v in (d.get("step") or {}).items() if k in StepCost.__annotations__}
        return cls(
            step=StepCost(**step),
            transfer=link(d.get("transfer")),
            kvstore_fetch=link(d.get("kvstore_fetch")),
            kvstore_publish=link(d.get("kvstore_publish")),
            router_overhead_s=float(d.get("router_overhead_s", 0.0)),
            token_overhead_s=float(d.get("token_overhead_s", 0.0)),
            stream_token_s=float(d.get("stream_token_s", 0.0)),
            prefill_chunk_s=float(d.get("prefill_chunk_s", 0.0)),
            prefill_token_s=float(d.get("prefill_token_s", 0.0)),
            kv_bytes_per_token=int(d.get("kv_bytes_per_token", 0)),
            kv_window=int(d.get("kv_window", 0)),
            kv_window_bytes_per_token=int(d.get("kv_window_bytes_per_token", 0)),
            name=str(d.get("name", "")),
            kv_capacity_bytes=d.get("kv_capacity_bytes"),
            devices=int(d.get("devices", 1)),
            neighbour_busy_factor=float(d.get("neighbour_busy_factor", 1.0)),
        )
