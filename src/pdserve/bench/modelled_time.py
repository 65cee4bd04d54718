"""Benchmarks of an emulated cluster in modelled time.

An emulated cluster started with `--time-scale X` runs X times slower than the hardware it
models. `bench serve --clock-scale X` (and `sim validate` for an arm with `--time-scale X`)
stretches the arrival times by X when sending, and divides every measured time by X before
the summary, so that rates, latencies and SLOs are all in modelled time."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from pdserve.workload.metrics import RequestRecord


def stretch_arrivals(reqs: list[Any], scale: float) -> list[Any]:
    if scale == 1.0:
        return reqs
    return [replace(r, arrival_s=r.arrival_s * scale) for r in reqs]


def to_modelled(records: list[RequestRecord], wall_s: float, scale: float):
    """Records and wall time with every time divided by `scale` (counts kept)."""
    if scale == 1.0:
        return records, wall_s
    out = []
    for r in records:
        stages = {k: (v / scale if k.endswith("_ms") else v) for k, v in r.stages.items()}
        out.append(
            replace(
                r,
                arrival_s=r.arrival_s / scale,
                send_s=r.send_s / scale,
                token_times=[t / scale for t in r.token_times],
                finish_s=None if r.finish_s is None else r.finish_s / scale,
                stages=stages,
            )
        )
    return out, wall_s / scale


def time_scale_of(flags: list[str]) -> float:
    """The `--time-scale X` of `pdserve up` flags (1.0 when absent)."""
    for i, f in enumerate(flags):
        if f == "--time-scale" and i + 1 < len(flags):
            return float(flags[i + 1])
        if f.startswith("--time-scale="):
            return float(f.split("=", 1)[1])
    return 1.0
