"""PNG plots (matplotlib, Agg backend): latency CDFs, SLO attainment vs rate, cache curves.
Every function takes plain data (arm name -> values) and returns the paths it wrote."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np


def _pyplot():  # imported lazily so the CLI starts fast; Agg: no display needed
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(
    arms: Mapping[str, Mapping[str, Sequence[float]]], out_dir: str | Path, prefix: str = ""
) -> list[Path]:
    """`arms[name][metric]` = per-request values in ms, metric in ttft|tpot|e2e|itl.
    Writes one PNG per metric with one CDF line per arm."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    metrics = sorted({m for per in arms.values() for m in per})
    paths = []
    for metric in metrics:
        fig, ax = plt.subplots(figsize=(6, 4))
        drawn = 0
        for name, per in arms.items():
            vals = np.sort(np.asarray(per.get(metric, []), dtype=float))
            if vals.size == 0:
                continue
            ax.step(vals, np.arange(1, vals.size + 1) / vals.size, where="post", label=name)
            drawn += 1
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_ylim(0, 1.02)
        ax.grid(True, alpha=0.3)
        ax.set_title(f"{metric.upper()} CDF")
        if drawn:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        path = out_dir / f"{prefix}cdf_{metric}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def plot_attainment(
    arms: Mapping[str, Sequence[tuple[float, float]]],
    out_path: str | Path,
    target: float = 0.9,
) -> Path:
    """`arms[name]` = [(rate, attainment)], one line per arm, the target as a dashed line."""
    plt = _pyplot()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, pts in arms.items():
        pts = sorted(pts)
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=name)
    ax.axhline(100 * target, linestyle="--", color="grey", label=f"{target:.0%} target")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 102)
    ax.grid(True, alpha=0.3)
    ax.legend()
    ax.set_title("SLO attainment (TTFT and TPOT) vs rate")
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


def plot_capacity_curve(
    capacities: Sequence[str], hit_rates: Sequence[float], best: float, out_path: str | Path
) -> Path:
    """Hit rate per cache capacity (categorical x axis), the unlimited best case dashed."""
    plt = _pyplot()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = np.arange(len(capacities))
    ax.plot(xs, [100 * h for h in hit_rates], marker="o", label="LRU (chain tail first)")
    ax.axhline(100 * best, linestyle="--", color="grey", label="unlimited (best case)")
    ax.set_xticks(xs, list(capacities))
    ax.set_xlabel("kvstore capacity")
    ax.set_ylabel("prefix hit rate (% of prompt tokens)")
    ax.set_ylim(0, 102)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
