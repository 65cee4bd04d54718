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

On a CPU a step's cost per new token is not constant: it falls from a handful of tokens to a
few hundred (the weights are read once for more rows) and rises again once a chunk's
activations outgrow the core's cache (bench50m fp32: 0.45 ms per token up to 256 tokens,
0.77 ms per token from 256 to 512). A fit with `token_knots` replaces `per_token_s *
new_tokens` with a piecewise-linear, non-decreasing G(new_tokens): `token_slopes[i]` seconds
per token between knot i and knot i + 1, the last slope beyond the last knot. The knots are
the prompt sizes the profile sampled, so each segment rests on measured steps.
"""

from __future__ import annotations

import itertools
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


def interpolate(x: float, points: Sequence[tuple[float, float]]) -> float:
    """Linear through (0, 0) and `points` (ascending x), the last segment's slope beyond."""
    px, py = 0.0, 0.0
    for qx, qy in points:
        if x <= qx:
            return py + (qy - py) * (x - px) / (qx - px)
        slope = (qy - py) / (qx - px)
        px, py = qx, qy
    return py + slope * (x - px)


def clamped(x: float, points: Sequence[tuple[float, float]]) -> float:
    """Linear between `points` (ascending x), flat before the first and after the last."""
    if x <= points[0][0]:
        return points[0][1]
    for (px, py), (qx, qy) in itertools.pairwise(points):
        if x <= qx:
            return py + (qy - py) * (x - px) / (qx - px)
    return points[-1][1]


def token_ramps(new_tokens: float, knots: Sequence[float]) -> np.ndarray:
    """The tokens of a step that fall in each segment between `knots` (the last one open):
    G(n) = token_ramps(n, knots) @ slopes."""
    out = np.zeros(len(knots))
    for i, k in enumerate(knots):
        hi = knots[i + 1] if i + 1 < len(knots) else math.inf
        out[i] = min(max(new_tokens - k, 0.0), hi - k)
    return out


def knots_of(batches: Sequence[Sequence[tuple[int, int]]], max_knots: int = 8) -> tuple[float, ...]:
    """Token knots for `StepCost.fit`: 0 and the new-token totals of the sampled prompt steps
    (steps with more new tokens than sequences) seen at least twice, but the largest (the
    last segment is open; at most `max_knots`, spread over the sizes)."""
    from collections import Counter

    seen = Counter(sum(n for _, n in b) for b in batches if sum(n for _, n in b) > len(b))
    sizes = sorted(t for t, c in seen.items() if c >= 2)[:-1]
    if len(sizes) > max_knots - 1:
        idx = np.linspace(0, len(sizes) - 1, max_knots - 1).round().astype(int)
        sizes = [sizes[i] for i in sorted(set(idx))]
    return (0.0, *(float(t) for t in sizes))


@dataclass
class StepCost:
    base_s: float = 0.0
    per_token_s: float = 0.0
    per_seq_s: float = 0.0
    per_ctx_token_s: float = 0.0
    per_attn_s: float = 0.0
    fit_rel_rmse: float | None = None  # relative RMS error of the fit on its samples
    # A piecewise-linear token term in place of per_token_s (see the module docstring):
    # knots ascending from 0, one slope per knot (seconds per token from that knot on)
    token_knots: tuple[float, ...] = ()
    token_slopes: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        self.token_knots = tuple(float(k) for k in self.token_knots)
        self.token_slopes = tuple(float(s) for s in self.token_slopes)
        if len(self.token_knots) != len(self.token_slopes):
            raise ValueError("token_knots and token_slopes differ in length")

    def coefs(self) -> np.ndarray:
        return np.array(
            [self.base_s, self.per_token_s, self.per_seq_s, self.per_ctx_token_s, self.per_attn_s]
        )

    def token_term_s(self, new_tokens: float) -> float:
        """Seconds for a step's new tokens: per_token_s * n, or G(n) with knots."""
        if not self.token_knots:
            return self.per_token_s * new_tokens
        return float(token_ramps(new_tokens, self.token_knots) @ np.asarray(self.token_slopes))

    def step_s(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        return self.features_s(plan_features(batch))

    def features_s(self, features: tuple[float, float, float, float, float]) -> float:
        """A non-empty step from its `plan_features`."""
        if not self.token_knots:
            return float(np.dot(self.coefs(), features))
        _, new, seqs, ctx, pairs = features
        return float(
            self.base_s + self.token_term_s(new) + self.per_seq_s * seqs
            + self.per_ctx_token_s * ctx + self.per_attn_s * pairs
        )  # fmt: skip

    def scaled(self, factor: float) -> StepCost:
        c = self.coefs() * factor
        return StepCost(
            *c.tolist(),
            fit_rel_rmse=self.fit_rel_rmse,
            token_knots=self.token_knots,
            token_slopes=tuple(s * factor for s in self.token_slopes),
        )

    @classmethod
    def fit(
        cls,
        batches: Sequence[Sequence[tuple[int, int]]],
        times_s: Sequence[float],
        token_knots: Sequence[float] = (),
    ) -> StepCost:
        """Non-negative least squares of step time on the features, weighted by 1/time so
        that short decode steps count as much as long prefills (relative error). With
        `token_knots` (ascending, from 0) the new-token column becomes one ramp per segment
        (`token_ramps`), each slope >= 0, so G is piecewise linear and never decreasing."""
        feats = np.array([plan_features(b) for b in batches], dtype=float)
        y = np.asarray(times_s, dtype=float)
        if len(y) == 0:
            raise ValueError("no samples to fit")
        knots = tuple(float(k) for k in token_knots)
        if knots:
            if knots[0] != 0.0 or any(b <= a for a, b in itertools.pairwise(knots)):
                raise ValueError(f"token knots must ascend from 0: {knots}")
            ramps = np.array([token_ramps(f[1], knots) for f in feats])
            x = np.hstack([feats[:, :1], ramps, feats[:, 2:]])
        else:
            x = feats
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
        if not knots:
            return cls(*coef.tolist(), fit_rel_rmse=rel)
        k = len(knots)
        slopes = tuple(float(v) for v in coef[1 : 1 + k])
        base, seq, ctx, attn = (float(v) for v in (coef[0], *coef[1 + k :]))
        return cls(base, slopes[0], seq, ctx, attn, fit_rel_rmse=rel,
                   token_knots=knots, token_slopes=slopes)  # fmt: skip

    @classmethod
    def fit_floor(
        cls,
        batches: Sequence[Sequence[tuple[int, int]]],
        times_s: Sequence[float],
        slack: float = 1.15,
        rounds: int = 4,
        keep_at_least: float = 0.3,
        token_knots: Sequence[float] = (),
    ) -> StepCost:
        """The lower envelope: on a shared machine other processes only ever slow a step
        down, so refit on the samples at most `slack` x the current fit (a few rounds, never
        fewer than `keep_at_least` of them). The uncontended cost of a step."""
        idx = np.arange(len(times_s))
        fit = cls.fit(batches, times_s, token_knots)
        y = np.asarray(times_s, dtype=float)
        for _ in range(rounds):
            pred = np.array([fit.step_s(batches[i]) for i in range(len(y))])
            keep = idx[y <= slack * pred]
            if len(keep) < max(8, keep_at_least * len(y)):
                keep = idx[np.argsort(y / np.maximum(pred, 1e-9))][
                    : max(8, int(keep_at_least * len(y)))
                ]
            fit = cls.fit([batches[i] for i in keep], y[keep], token_knots)
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
    # A decode's share of a disaggregated request's path: the router's Reserve call's round
    # trip when it waits for no step (`pdserve profile` on a served 1P1D). It is part of
    # router_overhead_s, but it comes between placement and the Prefill call, and a 1-token
    # request, which reserves nothing, does not pay it.
    reserve_s: float = 0.0
    token_overhead_s: float = 0.0  # per streamed message (gRPC relay of one token)
    # The serving stack's work for one token of one stream, on the engine's machine (the
    # engine thread's emit, the worker's and the router's relay, their gRPC): charged per
    # sampled sequence per step, as it shares the CPU with the step (measured by `pdserve
    # profile`: served TPOT minus the engine-only step, per stream; 0 for a GPU engine
    # whose host work overlaps its kernels)
    stream_token_s: float = 0.0
    # The same measured per step at a few stream counts, ((streams, seconds per step), ...)
    # ascending: a served worker's TPOT minus its engine-only step. When given, a step that
    # samples n sequences pays it interpolated (`stream_s`), not stream_token_s * n: the
    # decode's tokens leave in one message per step, so the work per step is not
    # proportional to its streams (bench50m fp32: +1.2 ms at 1 stream, +1.7 ms at 4)
    stream_points: tuple[tuple[float, float], ...] = ()
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
    # The same by the neighbour's batch, ((sequences in the neighbour's step, factor), ...)
    # ascending, interpolated and flat beyond its ends (`neighbour_factor`): a decode of one
    # stream slows a prefill beside it less than a decode of four. Empty: the one factor.
    neighbour_points: tuple[tuple[float, float], ...] = ()
    # A step with a prompt chunk that starts after its instance stepped nothing for at least
    # `cold_after_s` costs `cold_prompt_s` more: on a CPU host the weights and activations
    # it left in the caches are gone by then (the neighbour's and the serving stack's work
    # replaced them), and the step reads them from memory again. `pdserve profile` measures
    # it on the served 1P1D prefill (a prompt after a pause beside a stepping decode, less the
    # same prompt back to back: the worker's own step seconds); 0 for accelerators.
    cold_prompt_s: float = 0.0
    cold_after_s: float = 0.25

    def neighbour_factor(self, neighbour_seqs: int) -> float:
        """A step's cost multiplier while a neighbour steps `neighbour_seqs` sequences."""
        if not self.neighbour_points:
            return self.neighbour_busy_factor
        return clamped(neighbour_seqs, self.neighbour_points)

    def step_time_s(self, batch: Sequence[tuple[int, int]], num_streamed: int) -> float:
        """One engine step of `batch` that samples `num_streamed` sequences."""
        if not batch:
            return 0.0
        t = self.step.step_s(batch) + self.stream_s(num_streamed)
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
        t = self.step.features_s(features) + self.stream_s(num_streamed)
        if self.serves_prefill_extra:
            t += self.prefill_chunk_s * prefill_chunks + self.prefill_token_s * prefill_tokens
        return t

    def stream_s(self, num_streamed: int) -> float:
        """The serving stack's work of a step that samples `num_streamed` sequences."""
        if not self.stream_points or not num_streamed:
            return self.stream_token_s * num_streamed
        return interpolate(num_streamed, self.stream_points)

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
            reserve_s=float(d.get("reserve_s", 0.0)),
            token_overhead_s=float(d.get("token_overhead_s", 0.0)),
            stream_token_s=float(d.get("stream_token_s", 0.0)),
            stream_points=tuple((float(x), float(y)) for x, y in d.get("stream_points") or ()),
            prefill_chunk_s=float(d.get("prefill_chunk_s", 0.0)),
            prefill_token_s=float(d.get("prefill_token_s", 0.0)),
            kv_bytes_per_token=int(d.get("kv_bytes_per_token", 0)),
            kv_window=int(d.get("kv_window", 0)),
            kv_window_bytes_per_token=int(d.get("kv_window_bytes_per_token", 0)),
            name=str(d.get("name", "")),
            kv_capacity_bytes=d.get("kv_capacity_bytes"),
            devices=int(d.get("devices", 1)),
            neighbour_busy_factor=float(d.get("neighbour_busy_factor", 1.0)),
            neighbour_points=tuple(
                (float(x), float(y)) for x, y in d.get("neighbour_points") or ()
            ),
            cold_prompt_s=float(d.get("cold_prompt_s", 0.0)),
            cold_after_s=float(d.get("cold_after_s", 0.25)),
        )
