"""Goodput, two ways.

1. vLLM's: requests per second, at the offered rate, that met every SLO given
   (completed requests meeting all SLOs / run duration).
2. DistServe's: the highest request rate at which >= 90% of requests meet both the TTFT and
   TPOT SLOs. Found from a rate sweep (explicit rates) or an automatic search (double until
   attainment drops below the target, then bisect between the last pass and the first fail).
A request whose TPOT is undefined (one output token) meets any TPOT SLO; a failed request
meets none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from pdserve.workload.metrics import RequestRecord

SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class SLO:
    """Latency objectives in ms; None = no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, items: Sequence[str]) -> SLO:
        """["ttft:500", "tpot:50", "e2e:4000"] (also "ttft=500")."""
        vals: dict[str, float] = {}
        for item in items:
            key, sep, value = item.replace("=", ":").partition(":")
            key = key.strip().lower()
            if not sep or key not in SLO_KEYS:
                raise ValueError(f"bad SLO {item!r}: use ttft:MS, tpot:MS or e2e:MS")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"bad SLO {item!r}: {value!r} is not a number") from None
            if ms <= 0:
                raise ValueError(f"bad SLO {item!r}: must be > 0 ms")
            vals[f"{key}_ms"] = ms
        return cls(**vals)

    def only(self, *keys: str) -> SLO:
        return SLO(**{f"{k}_ms": getattr(self, f"{k}_ms") for k in keys})

    def is_empty(self) -> bool:
        return all(getattr(self, f"{k}_ms") is None for k in SLO_KEYS)

    def to_json(self) -> dict[str, float | None]:
        return asdict(self)


def meets(record: RequestRecord, slo: SLO) -> bool:
    if not record.ok:
        return False
    checks = (
        (slo.ttft_ms, record.ttft_s),
        (slo.tpot_ms, record.tpot_s),
        (slo.e2e_ms, record.e2e_s),
    )
    for limit_ms, value_s in checks:
        if limit_ms is None or value_s is None:
            continue
        if value_s * 1000.0 > limit_ms:
            return False
    return True


def attainment(records: Sequence[RequestRecord], slo: SLO) -> float:
    """Fraction of all requests (failed ones included) meeting `slo`."""
    if not records:
        return 0.0
    return sum(meets(r, slo) for r in records) / len(records)


def vllm_goodput(records: Sequence[RequestRecord], slo: SLO, duration_s: float) -> float:
    """Requests/s that met every SLO at the offered rate."""
    if duration_s <= 0:
        return 0.0
    return sum(meets(r, slo) for r in records) / duration_s


@dataclass(frozen=True)
class SweepPoint:
    rate: float
    attainment: float


def distserve_goodput(points: Sequence[SweepPoint], target: float = 0.9) -> dict[str, float | None]:
    """From (rate, attainment) points: `max_rate` = highest measured rate meeting the target
    such that every lower measured rate meets it too; `interpolated` = the linear crossing
    between it and the next (failing) rate; None when even the lowest rate fails."""
    pts = sorted(points, key=lambda p: p.rate)
    best: SweepPoint | None = None
    nxt: SweepPoint | None = None
    for p in pts:
        if p.attainment >= target:
            best = p
        else:
            nxt = p
            break
    if best is None:
        return {"max_rate": None, "interpolated": None, "target": target}
    interp = best.rate
    if nxt is not None and best.attainment > nxt.attainment:
        frac = (best.attainment - target) / (best.attainment - nxt.attainment)
        interp = best.rate + frac * (nxt.rate - best.rate)
    return {"max_rate": best.rate, "interpolated": interp, "target": target}


def search_goodput_rate(
    measure: Callable[[float], float],
    start_rate: float = 1.0,
    target: float = 0.9,
    max_steps: int = 6,
    bisect_steps: int = 3,
    min_rate: float = 1e-3,
) -> list[SweepPoint]:
    """Bracket the target crossing by doubling/halving from `start_rate`, then bisect.
    `measure(rate)` runs the load at `rate` and returns its attainment. Returns every point
    measured; feed them to `distserve_goodput`."""
    points: list[SweepPoint] = []

    def run(rate: float) -> bool:
        att = measure(rate)
        points.append(SweepPoint(rate, att))
        return att >= target

    rate = start_rate
    lo: float | None = None
    hi: float | None = None
    if run(rate):
        lo = rate
        for _ in range(max_steps):
            rate *= 2
            if not run(rate):
                hi = rate
                break
            lo = rate
    else:
        hi = rate
        for _ in range(max_steps):
            rate /= 2
            if rate < min_rate:
                break
            if run(rate):
                lo = rate
                break
            hi = rate
    if lo is None or hi is None:
        return points
    for _ in range(bisect_steps):
        mid = (lo + hi) / 2
        if run(mid):
            lo = mid
        else:
            hi = mid
    return points
