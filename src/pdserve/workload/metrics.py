"""Per-request records and the summary statistics of a run.

Definitions (all client-side, times in seconds from the start of the run):
  TTFT  = first token arrival - send time
  E2E   = last message arrival - send time
  TPOT  = (E2E - TTFT) / (n_out - 1), per request; undefined for n_out <= 1
  ITL   = every gap between consecutive output tokens (tokens that arrive in one message
          share its arrival time, so their gaps are 0)
Percentiles interpolate linearly between order statistics (numpy's default).
Failed requests are counted, but excluded from latencies and throughput.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

STAGE_FIELDS = (
    "queue_ms",
    "prefill_ms",
    "transfer_ms",
    "transfer_bytes",
    "decode_ms",
    "cached_tokens",
    "kvstore_tokens",
    "reserve_ms",
)
PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    index: int
    arrival_s: float  # scheduled arrival
    send_s: float  # when the load generator actually sent it
    n_in: int
    max_tokens: int
    token_times: list[float] = field(default_factory=list)  # one entry per output token
    finish_s: float | None = None
    n_out: int = 0
    cached_tokens: int = 0
    stages: dict[str, float] = field(default_factory=dict)  # usage.stages (STAGE_FIELDS)
    finish_reason: str = ""
    error: str | None = None
    session_id: str | None = None
    turn: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_s is not None and self.n_out > 0

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.send_s if self.ok and self.token_times else None

    @property
    def e2e_s(self) -> float | None:
        return self.finish_s - self.send_s if self.ok and self.finish_s is not None else None

    @property
    def tpot_s(self) -> float | None:
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.n_out <= 1:
            return None
        return (e2e - ttft) / (self.n_out - 1)

    @property
    def itls_s(self) -> list[float]:
        if not self.ok:
            return []
        return np.diff(np.asarray(self.token_times, dtype=float)).tolist()

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft_s=self.ttft_s, tpot_s=self.tpot_s, e2e_s=self.e2e_s)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestRecord:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})


def stats_ms(values_s: Iterable[float | None]) -> dict[str, float | int | None]:
    """mean / p50 / p90 / p99 / count of the non-None values, converted to ms."""
    return _stats(np.asarray([v for v in values_s if v is not None], dtype=float))


def _stats(arr_s: np.ndarray) -> dict[str, float | int | None]:
    arr = arr_s * 1000.0
    out: dict[str, float | int | None] = {"count": int(arr.size)}
    if arr.size == 0:
        out.update(mean=None, **{f"p{p}": None for p in PERCENTILES})
        return out
    out["mean"] = float(arr.mean())
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


def itl_stats_ms(records: Sequence[RequestRecord]) -> dict[str, float | int | None]:
    """`stats_ms` of every inter-token latency of `records` (`itls_s`, in order), without a
    Python float per token (a run has millions): the same array, so the same figures."""
    parts = [np.diff(np.asarray(r.token_times, dtype=float)) for r in records if r.ok]
    return _stats(np.concatenate(parts) if parts else np.empty(0, dtype=float))


def stage_totals(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """Summed and per-request stage costs over the completed requests, so prefill time,
    decode time and transfer can be compared stage by stage between arms."""
    done = [r for r in records if r.ok]
    total = {k: float(sum(r.stages.get(k, 0.0) for r in done)) for k in STAGE_FIELDS}
    per = {k: (v / len(done) if done else 0.0) for k, v in total.items()}
    total_s = {
        "prefill_s": total["prefill_ms"] / 1e3,
        "decode_s": total["decode_ms"] / 1e3,
        "transfer_s": total["transfer_ms"] / 1e3,
        "queue_s": total["queue_ms"] / 1e3,
        "transfer_bytes": total["transfer_bytes"],
    }
    return {"total": total, "per_request": per, "total_seconds": total_s}


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> dict[str, Any]:
    """The summary of one run. `duration_s` defaults to first send -> last finish."""
    done = [r for r in records if r.ok]
    if duration_s is None:
        starts = [r.send_s for r in records]
        ends = [r.finish_s for r in done if r.finish_s is not None]
        duration_s = (max(ends) - min(starts)) if ends and starts else 0.0
    n_in = sum(r.n_in for r in done)
    n_out = sum(r.n_out for r in done)
    cached = sum(r.cached_tokens for r in done)
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    lag = [r.send_s - r.arrival_s for r in records]
    return {
        "num_requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "duration_s": duration_s,
        "request_throughput": per_s(len(done)),
        "input_token_throughput": per_s(n_in),
        "output_token_throughput": per_s(n_out),
        "total_input_tokens": n_in,
        "total_output_tokens": n_out,
        "cached_tokens": cached,
        "cache_hit_rate": cached / n_in if n_in else 0.0,
        "ttft_ms": stats_ms(r.ttft_s for r in done),
        "tpot_ms": stats_ms(r.tpot_s for r in done),
        "itl_ms": itl_stats_ms(done),
        "e2e_ms": stats_ms(r.e2e_s for r in done),
        "send_lag_ms": stats_ms(lag),
        "stages": stage_totals(records),
        "errors": sorted({r.error for r in records if r.error})[:10],
    }
