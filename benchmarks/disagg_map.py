"""Where disaggregation wins: `pdserve plan --map` for two models x three workload shapes,
one heatmap and one table.

    python -m benchmarks.disagg_map --out-dir bench-results/disagg_map --jobs 2
    python -m benchmarks.disagg_map --out-dir bench-results/disagg_map --report \
        --png docs/img/disagg_map.png

Models (the calibrated H100 roofline, `costmodel/roofline.py`): Llama-3-8B at TP 1 on one
8-GPU node (units up to M + N = 5, 20 s of arrivals per run), and Llama-3-70B on 32 H100s
with TP 4 or TP 8 per pool (`h100x4/8:32`, units up to M + N = 3, 30 s per run). Each cell:
the best colocated configuration (chunked prefill at 256-2,048 tokens (70B: 512, 2,048), or
no chunking at a 2,048-token budget) and the best disaggregated one (prefill chunk 2,048),
each replicated to the budget and walked at full scale, 90 % attainment of both SLOs.

Workload shapes (lengths in tokens; `lognormal:MEAN,SIGMA` = mean, sigma of the log):
- chat: the Azure LLM inference conversation trace (Splitwise, ISCA 2024), its own lengths
  (prompt median 1,020, output median 129) and arrival pattern, rescaled to each rate;
- code: the same paper's code trace statistics (prompt median 1,500, output median 13), as
  prompt lognormal:1800,0.6 (median 1,500) and output lognormal:21,1.0 (median 13), Poisson;
- summarization: long documents, an assumption (no public trace used): prompt
  uniform 4,096-7,680, output lognormal:256,0.5 (median 226), Poisson.
SLO grids are per model and shape, tight / medium / relaxed: TTFT about 3x / 10x / 30x a lone
median prompt's prefill, TPOT about 2x / 4x / 8x a batch-1 decode step (GRIDS).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

AZURE = "/work/shared/data/traces/azure_llm_2023_conv.csv"

SHAPES: dict[str, list[str]] = {
    "chat": ["--trace", AZURE],
    "code": ["--input-len", "lognormal:1800,0.6", "--output-len", "lognormal:21,1.0"],
    "summarization": ["--input-len", "uniform:4096,7680", "--output-len", "lognormal:256,0.5"],
}
# model -> (plan flags, TPOT grid)
MODELS: dict[str, tuple[list[str], str]] = {
    # one 8-GPU node; units up to M + N = 5
    "llama3-8b": (["--model-config", "llama3-8b", "--hardware", "h100:8", "--start-rate", "8",
                   "--max-unit", "5", "--chunks", "256,512,1024,2048", "--duration", "20"],
                  "15,30,60"),
    # four nodes; TP 4 or TP 8 per pool, units up to M + N = 3
    "llama3-70b": (["--model-config", "llama3-70b", "--hardware", "h100x4/8:32",
                    "--start-rate", "2", "--max-unit", "3", "--chunks", "512,2048",
                    "--duration", "30"], "30,60,120"),
}  # fmt: skip
TTFT: dict[tuple[str, str], str] = {
    ("llama3-8b", "chat"): "100,300,1000",
    ("llama3-8b", "code"): "150,500,1500",
    ("llama3-8b", "summarization"): "500,1500,5000",
    ("llama3-70b", "chat"): "200,600,2000",
    ("llama3-70b", "code"): "300,1000,3000",
    ("llama3-70b", "summarization"): "1200,4000,12000",
}


def plan_argv(model: str, shape: str, a: argparse.Namespace, out: Path) -> list[str]:
    flags, tpot = MODELS[model]
    return [
        "plan", "--map", *flags, *SHAPES[shape], "--map-ttft", TTFT[(model, shape)],
        "--map-tpot", tpot, "--nochunk-budget", "2048", "--disagg-chunks", "2048",
        "--decode-seqs", "256", "--seed", str(a.seed), "--jobs", str(a.jobs), "--out", str(out),
    ]  # fmt: skip


def run_panel(model: str, shape: str, a: argparse.Namespace) -> dict[str, Any]:
    from pdserve.cli.plan import add_parser
    from pdserve.cli.plan_map import run_map
    from pdserve.sim.candidates import Budget

    out = Path(a.out_dir) / f"{model}_{shape}.json"
    top = argparse.ArgumentParser()
    add_parser(top.add_subparsers())
    args = top.parse_args(plan_argv(model, shape, a, out))
    args.vocab_size = 128256

    def log(m: str) -> None:
        print(f"[{model} {shape}] {m}", file=sys.stderr, flush=True)

    res = run_map(args, Budget.parse(args.hardware), log)
    res["argv"] = ["pdserve", *plan_argv(model, shape, a, out)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str))
    log(f"wrote {out}: {res['runs']} runs (cell by cell >= {res['runs_cell_by_cell']})")
    return res


def short(label: str) -> str:
    """'disagg 2P:1D h100 chunk=2048 seqs=256' -> '2P:1D'; colocated -> 'c512' / 'nc'."""
    parts = label.split()
    if parts[0] == "disagg":
        hw = parts[2] if "/" in parts[2] or "x" in parts[2] else ""
        return f"{parts[1]}{' ' + hw if hw else ''}"
    hw = parts[1].split("x", 1)[1] if parts[1].count("x") > 1 else ""
    kind = "nc" if parts[2] == "no-chunk" else parts[2].replace("chunk=", "c")
    return f"{kind}{' ' + hw if hw else ''}"


def table(panels: dict[str, dict[str, Any]]) -> str:
    """Markdown: per panel and TTFT SLO, the ratio at each TPOT SLO (tight, medium,
    relaxed) with the best colocated / disaggregated units."""
    lines = ["| model, shape | TTFT SLO (ms) | TPOT tight | TPOT medium | TPOT relaxed |",
             "|---|---:|---|---|---|"]  # fmt: skip
    for name, res in panels.items():
        by = {(c["ttft_ms"], c["tpot_ms"]): c for c in res["cells"]}
        for t in res["grid"]["ttft_ms"]:
            cells = []
            for p in res["grid"]["tpot_ms"]:
                c = by[(t, p)]
                r = "-" if c["ratio"] is None else f"**{c['ratio']:.2f}**"
                who = " / ".join(short(c[k]["unit"]) if c[k] and c[k]["goodput_req_s"] else "-"
                                 for k in ("colocated", "disagg"))  # fmt: skip
                cells.append(f"{p:g} ms: {r} ({who})")
            lines.append(f"| {name} | {t:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def corners(panels: dict[str, dict[str, Any]]) -> str:
    """TaiChi's two corners per panel: tight TTFT with relaxed TPOT (colocation should
    win) and tight TPOT with relaxed TTFT (disaggregation should win); and the cells where
    disaggregation reaches 1.2x."""
    lines = ["| model, shape | tight TTFT, relaxed TPOT | tight TPOT, relaxed TTFT | "
             "cells >= 1.2x | range |", "|---|---:|---:|---|---|"]  # fmt: skip
    for name, res in panels.items():
        ttft, tpot = res["grid"]["ttft_ms"], res["grid"]["tpot_ms"]
        by = {(c["ttft_ms"], c["tpot_ms"]): c["ratio"] for c in res["cells"]}
        f = lambda r: "-" if r is None else f"{r:.2f}"  # noqa: E731
        wins = [f"{t:g}/{p:g}" for (t, p), r in by.items() if r is not None and r >= 1.2]
        vals = [r for r in by.values() if r is not None]
        rng = f"{min(vals):.2f}-{max(vals):.2f}" if vals else "-"
        lines.append(f"| {name} | {f(by[(ttft[0], tpot[-1])])} | {f(by[(ttft[-1], tpot[0])])} "
                     f"| {', '.join(wins) or 'none'} | {rng} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--out-dir", default="bench-results/disagg_map")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--seed", type=int, default=1, help="arrivals and lengths")
    p.add_argument("--report", action="store_true", help="only read the saved panels")
    p.add_argument("--png", help="the heatmap (default: OUT_DIR/disagg_map.png)")
    a = p.parse_args(argv)
    panels: dict[str, dict[str, Any]] = {}
    for model in a.models.split(","):
        for shape in a.shapes.split(","):
            path = Path(a.out_dir) / f"{model}_{shape}.json"
            if a.report:
                if path.exists():
                    panels[f"{model}, {shape}"] = json.loads(path.read_text())
                continue
            panels[f"{model}, {shape}"] = run_panel(model, shape, a)
    from pdserve.bench.plots import plot_ratio_maps

    png = plot_ratio_maps(panels, a.png or Path(a.out_dir) / "disagg_map.png")
    print(table(panels))
    print()
    print(corners(panels))
    print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
