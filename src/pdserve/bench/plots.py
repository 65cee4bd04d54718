"""PNG plots (matplotlib, Agg backend): latency CDFs, SLO attainment vs rate, cache curves.
Every function takes plain data (arm name -> values) and returns the paths it wrote."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

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


def plot_ratio_maps(
    panels: Mapping[str, Mapping[str, Any]],
    out_path: str | Path,
    title: str = "per-device goodput, best disaggregated / best colocated",
) -> Path:
    """One heatmap per panel (`panels[name]` = a `sim.slo_map` result: its grid and cells),
    side by side: TTFT SLO rows x TPOT SLO columns, each cell's ratio written in it (a
    diverging scale centred on 1: blue where colocation wins, red where disaggregation does;
    '-' where neither meets the SLOs)."""
    from matplotlib.colors import TwoSlopeNorm

    plt = _pyplot()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    n = len(panels)
    cols = min(n, 3)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.8 * cols + 1.0, 3.2 * rows + 0.6),
                             squeeze=False, layout="constrained")  # fmt: skip
    norm = TwoSlopeNorm(vmin=0.5, vcenter=1.0, vmax=1.5)
    image = None
    for ax, (name, res) in zip(axes.flat, panels.items(), strict=False):
        ttft, tpot = res["grid"]["ttft_ms"], res["grid"]["tpot_ms"]
        vals = np.full((len(ttft), len(tpot)), np.nan)
        for c in res["cells"]:
            if c["ratio"] is not None:
                vals[ttft.index(c["ttft_ms"]), tpot.index(c["tpot_ms"])] = c["ratio"]
        image = ax.imshow(np.clip(vals, 0.5, 1.5), cmap="RdBu_r", norm=norm, origin="lower",
                          aspect="auto")  # fmt: skip
        for (r, k), v in np.ndenumerate(vals):
            ax.text(k, r, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center",
                    fontsize=9, color="black")  # fmt: skip
        ax.set_xticks(range(len(tpot)), [f"{v:g}" for v in tpot])
        ax.set_yticks(range(len(ttft)), [f"{v:g}" for v in ttft])
        ax.set_xlabel("TPOT SLO (ms)")
        ax.set_ylabel("TTFT SLO (ms)")
        ax.set_title(name, fontsize=10)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="disagg / colocated")
    fig.suptitle(title, fontsize=11)
    fig.savefig(out_path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return out_path
