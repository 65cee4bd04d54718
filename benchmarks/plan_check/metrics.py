"""The figures `plan_check` keeps of one run, simulated or emulated (modelled time): SLO
attainment (both SLOs, and each alone, to say which one binds), TTFT and TPOT p50 / p90; and
the simulator's error against emulation on the same requests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pdserve.workload.goodput import SLO, attainment
from pdserve.workload.metrics import summarize


def run_metrics(records: Sequence[Any], reqs: Sequence[Any], slo: SLO) -> dict[str, Any]:
    ends = [r.finish_s for r in records if r.finish_s is not None]
    s = summarize(records, max(ends) if ends else 0.0)
    return {
        "attainment": attainment(records, slo),
        "attainment_ttft": attainment(records, slo.only("ttft")),
        "attainment_tpot": attainment(records, slo.only("tpot")),
        "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
        "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p90_ms": s["tpot_ms"]["p90"],
        "completed": s["completed"], "num_requests": len(reqs),
    }  # fmt: skip


PAIRED = ("attainment", "ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms", "tpot_p90_ms")


def pair_errors(sim: dict[str, Any], emu: dict[str, Any]) -> dict[str, Any]:
    """The simulator against emulation on the same requests at one rate: each metric's
    |sim - emu| / emu, and the largest (`max_rel_error`)."""
    errs = {k: abs(sim[k] - emu[k]) / abs(emu[k]) for k in PAIRED
            if sim.get(k) is not None and emu.get(k)}  # fmt: skip
    return {"sim": {k: sim.get(k) for k in PAIRED}, "rel_error": errs,
            "max_rel_error": max(errs.values()) if errs else None}  # fmt: skip
