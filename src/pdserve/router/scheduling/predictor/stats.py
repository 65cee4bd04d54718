"""Rank statistics for judging a length predictor, numpy only: Kendall tau-b,
Spearman rho, and a bundle of the figures `pdserve predictor evaluate` prints."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np


def kendall_tau(x: Sequence[float], y: Sequence[float], chunk: int = 1024) -> float:
    """Kendall's tau-b (ties counted as in scipy). O(n^2) in chunks of rows, so a
    few thousand points are fine; 0.0 when either side is constant."""
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    n = len(a)
    if n < 2 or len(b) != n:
        return 0.0
    s = na = nb = 0.0
    for start in range(0, n, chunk):
        da = np.sign(a[start : start + chunk, None] - a[None, :])
        db = np.sign(b[start : start + chunk, None] - b[None, :])
        s += float((da * db).sum())
        na += float(np.count_nonzero(da))
        nb += float(np.count_nonzero(db))
    if na == 0 or nb == 0:
        return 0.0
    return s / float(np.sqrt(na * nb))


def _ranks(v: np.ndarray) -> np.ndarray:
    """Average ranks (ties share the mean rank)."""
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(len(v), dtype=np.float64)
    sv = v[order]
    i = 0
    while i < len(v):
        j = i
        while j + 1 < len(v) and sv[j + 1] == sv[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0
        i = j + 1
    return ranks


def spearman(x: Sequence[float], y: Sequence[float]) -> float:
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    if len(a) < 2:
        return 0.0
    ra, rb = _ranks(a), _ranks(b)
    ra -= ra.mean()
    rb -= rb.mean()
    den = float(np.sqrt((ra * ra).sum() * (rb * rb).sum()))
    return float((ra * rb).sum()) / den if den else 0.0


def summarize(
    p50: Sequence[float],
    p90: Sequence[float],
    actual: Sequence[float],
    groups: Sequence[str] | None = None,
    min_group: int = 20,
    bucket: int = 100,
) -> dict[str, float | int | dict[str, float]]:
    """The evaluate report: n, pooled Kendall tau, median per-group tau (groups
    with at least `min_group` rows), Spearman, MAE of log length, p90 coverage
    (share of actual <= p90) and accuracy in `bucket`-token buckets."""
    p = np.asarray(p50, dtype=np.float64)
    q = np.asarray(p90, dtype=np.float64)
    y = np.asarray(actual, dtype=np.float64)
    out: dict[str, float | int | dict[str, float]] = {"n": len(y)}
    if len(y) == 0:
        return out
    out["kendall_tau"] = round(kendall_tau(p, y), 4)
    per: dict[str, float] = {}
    if groups is not None:
        idx: dict[str, list[int]] = defaultdict(list)
        for i, g in enumerate(groups):
            idx[g].append(i)
        for g in sorted(idx):
            if len(idx[g]) >= min_group:
                ii = np.asarray(idx[g])
                per[g] = round(kendall_tau(p[ii], y[ii]), 4)
    out["kendall_tau_per_model"] = round(float(np.median(list(per.values()))), 4) if per else 0.0
    out["models_evaluated"] = len(per)
    out["spearman"] = round(spearman(p, y), 4)
    out["mae_log"] = round(float(np.mean(np.abs(np.log1p(p) - np.log1p(y)))), 4)
    out["p90_coverage"] = round(float(np.mean(y <= q)), 4)
    out["bucket_accuracy"] = round(float(np.mean((p // bucket) == (y // bucket))), 4)
    out["tau_by_model"] = per
    return out
