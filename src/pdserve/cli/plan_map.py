"""`pdserve plan --map --map-ttft 100,250,1000 --map-tpot 20,50,100 ...`: per cell of the
TTFT x TPOT grid, the best colocated and the best disaggregated configuration and the ratio
of their per-device goodputs (pdserve.sim.slo_map); JSON + a PNG heatmap."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def add_map_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("the map (--map): where disaggregation wins over SLO ranges")
    g.add_argument("--map", action="store_true",
                   help="search every TTFT x TPOT cell: best disagg / best colocated per device")  # fmt: skip
    g.add_argument("--map-ttft", default="100,250,1000", help="TTFT SLOs of the grid, ms")
    g.add_argument("--map-tpot", default="20,50,100", help="TPOT SLOs of the grid, ms")
    g.add_argument("--nochunk-budget", type=int,
                   help="token budget of the unchunked colocated units (default: the largest "
                   "of --chunks)")  # fmt: skip
    g.add_argument("--disagg-chunks",
                   help="prefill pools' token budgets (default: --chunks)")  # fmt: skip


def ratio_table(res: dict[str, Any]) -> str:
    """TTFT rows x TPOT columns of ratios ('-': neither kind meets the cell's SLOs)."""
    ttft, tpot = res["grid"]["ttft_ms"], res["grid"]["tpot_ms"]
    by = {(c["ttft_ms"], c["tpot_ms"]): c for c in res["cells"]}
    corner = "TTFT \\ TPOT"
    head = f"{corner:<12}" + "".join(f"{f'{p:g} ms':>10}" for p in tpot)
    lines = [head]
    for t in ttft:
        row = [by[(t, p)]["ratio"] for p in tpot]
        lines.append(f"{f'{t:g} ms':<12}" + "".join(
            f"{'-' if r is None else f'{r:.2f}':>10}" for r in row))  # fmt: skip
    return "\n".join(lines)


def cell_lines(res: dict[str, Any]) -> list[str]:
    out = []
    for c in res["cells"]:
        parts = []
        for kind in ("colocated", "disagg"):
            b = c[kind]
            parts.append("-" if not b else f"{b['unit']} x{b['replicas']}: "
                         f"{b['per_device_goodput']:.2f}/device")  # fmt: skip
        r = c["ratio"]
        out.append(f"TTFT {c['ttft_ms']:g} / TPOT {c['tpot_ms']:g} ms: "
                   f"{'-' if r is None else f'{r:.2f}'}  [{parts[0]} | {parts[1]}]")  # fmt: skip
    return out


def run_map(args: argparse.Namespace, budget: Any, log: Callable[[str], None]) -> dict[str, Any]:
    from pdserve.costmodel.shapes import load_model_config
    from pdserve.sim.candidates import candidates
    from pdserve.sim.slo_map import Grid, slo_map

    grid = Grid.parse(args.map_ttft, args.map_tpot)
    shape = load_model_config(args.model_config)
    max_model_len = args.max_model_len or shape.max_position_embeddings
    chunks = [int(x) for x in args.chunks.split(",")]
    modes = args.colocated_modes or "chunked,nochunk"
    cands = candidates(
        budget, args.model_config, args.network, args.dtype, chunks,
        [int(x) for x in args.decode_seqs.split(",")], args.max_unit, colocated_modes=modes,
        kv_dtype=args.kv_dtype, nochunk_budgets=[args.nochunk_budget or max(chunks)],
        disagg_chunks=[int(x) for x in args.disagg_chunks.split(",")]
        if args.disagg_chunks else None,
    )  # fmt: skip
    res = slo_map(args, budget, cands, grid, max_model_len, args.target, log)
    return res | {"model": shape.name, "dtype": args.dtype, "budget": budget.devices,
                  "network": args.network}  # fmt: skip


def main_map(args: argparse.Namespace, budget: Any) -> int:
    import json
    import time

    from pdserve.bench.plots import plot_ratio_maps
    from pdserve.bench.report import write_json

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    t0 = time.perf_counter()
    try:
        res = run_map(args, budget, log)
    except ValueError as exc:
        raise SystemExit(f"pdserve plan: {exc}") from None
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    log(f"map took {res['wall_s']} s wall: {res['runs']} simulations (cell by cell: at least "
        f"{res['runs_cell_by_cell']})")  # fmt: skip
    out = Path(args.out)
    title = f"{res['model']} on {budget.devices}: best disagg / best colocated, per device"
    png = plot_ratio_maps({args.trace or "synthetic": res}, out.with_suffix(".png"), title)
    res["plot"] = str(png)
    path = write_json(out, res | {"config": {k: v for k, v in vars(args).items() if k != "func"}})
    if args.json:
        json.dump(res, sys.stdout, indent=1, default=str)
        print()
        return 0
    print(f"model {res['model']}, budget {res['budget']}, attainment target {res['target']:.0%}")
    print("per-device goodput, best disaggregated / best colocated:")
    print(ratio_table(res))
    print()
    print("\n".join(cell_lines(res)))
    print(f"wrote {path}, {png}")
    return 0
