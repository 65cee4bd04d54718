"""Means with 95 % confidence intervals (Student t) for the benchmarks' repeated samples."""

from __future__ import annotations

import statistics
from typing import Any

# two-sided 95 % Student t quantiles, df = 1..30 (beyond: 1.96)
_T95 = (12.71, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
        2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
        2.060, 2.056, 2.052, 2.048, 2.045, 2.042)  # fmt: skip


def ci95(xs: list[float]) -> dict[str, Any]:
    """Mean and a 95 % confidence interval (Student t) of `xs`."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return {"mean": m, "ci95": None, "n": len(xs)}
    half = _T95[min(len(xs) - 1, len(_T95)) - 1] * statistics.stdev(xs) / len(xs) ** 0.5
    return {"mean": m, "ci95": [m - half, m + half], "n": len(xs)}


def fmt_ci(stat: dict[str, Any] | None, digits: int = 1) -> str:
    if stat is None:
        return "-"
    ci = stat["ci95"]
    rng = f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" if ci else ""
    return f"{stat['mean']:.{digits}f}{rng}"
