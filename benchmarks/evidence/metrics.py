"""The metrics of one evidence run, simulated or emulated: goodput, attainment, E2E."""

from __future__ import annotations

from typing import Any

from pdserve.workload.goodput import SLO, attainment
from pdserve.workload.metrics import summarize


def arm_metrics(records: list[Any], reqs: list[Any], slo: SLO) -> dict[str, Any]:
    """Goodput, attainment, mean and p99 E2E of one run (simulated or emulated, in modelled
    time); `completed` of `len(reqs)`."""
    ends = [r.finish_s for r in records if r.finish_s is not None]
    s = summarize(records, max(ends) if ends else 0.0)
    arrivals = [r.arrival_s for r in reqs]
    span = max(arrivals) - min(arrivals)
    att = attainment(records, slo)
    return {
        # requests/s meeting both SLOs over the arrival window (not over the drain, whose
        # length is set by the single longest answer)
        "goodput": att * len(reqs) / span if span > 0 else 0.0,
        "attainment": att,
        "e2e_mean": s["e2e_ms"]["mean"],
        "e2e_p99": s["e2e_ms"]["p99"],
        "completed": s["completed"],
        # per request, for comparing an emulated run with its twin: [index, TTFT s, E2E s]
        "timeline": [[r.index, _r4(r.ttft_s), _r4(r.e2e_s)] for r in records],
    }


def _r4(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
