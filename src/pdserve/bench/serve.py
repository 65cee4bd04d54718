"""`pdserve bench serve --addr HOST:PORT`: open-loop serving benchmark against a running router.

One run at `--rate` (or the trace's own timestamps), or a rate sweep (`--sweep-rates 0.5,1,2`
or `--sweep-rates auto`) for DistServe's goodput. Writes the JSON result and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench.loadgen import open_client, run_load, send_one
from pdserve.bench.modelled_time import stretch_arrivals, to_modelled
from pdserve.bench.plots import plot_attainment, plot_latency_cdfs
from pdserve.bench.report import format_summary, latency_arrays, write_json
from pdserve.workload import arrivals
from pdserve.workload.goodput import (
    SLO,
    SweepPoint,
    attainment,
    distserve_goodput,
    search_goodput_rate,
    vllm_goodput,
)
from pdserve.workload.metrics import summarize
from pdserve.workload.requests import BenchRequest
from pdserve.workload.spec import (
    WARMUP_SALT,
    add_workload_args,
    base_requests,
    offered_rate,
    workload_at,
)


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="open-loop serving benchmark against a router")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--out", default="results/serve.json", help="JSON result path")
    p.add_argument("--plots", help="plot directory (default: next to --out)")
    add_workload_args(p)
    p.set_defaults(func=main)


def run_once(
    addr: str, args: argparse.Namespace, rate: float | None, slo: SLO, salt: int = 0
) -> dict[str, Any]:
    reqs = workload_at(args, rate, salt)
    scale = getattr(args, "clock_scale", 1.0) or 1.0

    async def go() -> tuple[list, float]:
        async with open_client(addr) as client:
            return await run_load(
                client,
                stretch_arrivals(reqs, scale),
                temperature=args.temperature,
                seed=args.seed,
                progress=not args.no_progress,
                desc=f"rate {rate}" if rate else "requests",
            )

    records, wall = to_modelled(*asyncio.run(go()), scale)
    summary = summarize(records, wall)
    ts = slo.only("ttft", "tpot")
    return {
        "rate": rate if rate is not None else arrivals.mean_rate([r.arrival_s for r in reqs]),
        "offered": offered_rate(reqs, args),
        "records": [r.to_json() for r in records],
        "summary": summary,
        "vllm_goodput_req_s": vllm_goodput(records, slo, wall) if not slo.is_empty() else None,
        "attainment_ttft_tpot": attainment(records, ts) if not ts.is_empty() else None,
        "_records": records,
    }


async def _warmup(addr: str, reqs: list[BenchRequest], temperature: float) -> None:
    """Sequential requests that pay one-time costs (first model step, connections)."""
    async with open_client(addr) as client:
        for req in reqs:
            await send_one(client, req, 0.0, temperature=temperature)


def parse_rates(spec: str) -> list[float]:
    try:
        rates = [float(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad --sweep-rates {spec!r}: comma-separated numbers or 'auto'") from None
    if not rates or any(r <= 0 for r in rates):
        raise ValueError(f"bad --sweep-rates {spec!r}: rates must be > 0")
    return sorted(rates)


def warm_up(addr: str, args: argparse.Namespace) -> None:
    """The --warmup requests, unmeasured, one by one (at most 4 tokens each)."""
    if args.warmup > 0:
        warm = [
            replace(r, arrival_s=0.0, max_tokens=min(r.max_tokens, 4))
            for r in base_requests(args, n_hint=args.warmup, salt=WARMUP_SALT)[: args.warmup]
        ]
        asyncio.run(_warmup(addr, warm, args.temperature))


def run_benchmark(addr: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run, or a sweep; returns the JSON-ready result (runs keep their records)."""
    slo = SLO.parse(args.goodput)
    warm_up(addr, args)
    return sweep_result(
        args,
        slo,
        lambda rate, salt: run_once(addr, args, rate, slo, salt=salt),
        {"addr": addr},
    )


def sweep_result(
    args: argparse.Namespace,
    slo: SLO,
    once: Callable[[float, int], dict[str, Any]],
    config_extra: dict[str, Any],
) -> dict[str, Any]:
    """Run `once(rate, salt)` at --rate, or over --sweep-rates (a list or the DistServe-style
    search), and shape the result: the headline run is the highest rate meeting the target in
    a sweep, else the only run. Shared by the real benchmark and the simulator."""
    runs: list[dict[str, Any]] = []
    if args.sweep_rates:
        ts = slo.only("ttft", "tpot")
        if ts.ttft_ms is None or ts.tpot_ms is None:
            raise ValueError("--sweep-rates needs both SLOs: --goodput ttft:MS tpot:MS")

        def measure(rate: float) -> float:
            runs.append(once(rate, len(runs)))
            return runs[-1]["attainment_ttft_tpot"]

        if args.sweep_rates == "auto":
            points = search_goodput_rate(measure, args.sweep_start, args.target)
        else:
            points = [SweepPoint(r, measure(r)) for r in parse_rates(args.sweep_rates)]
        ds = distserve_goodput(points, args.target)
    else:
        runs.append(once(args.rate, 0))
        ds = None
    main_run = runs[0]
    if ds and ds["max_rate"] is not None:
        main_run = next(r for r in runs if r["rate"] == ds["max_rate"])
    return {
        "config": {k: v for k, v in vars(args).items() if k != "func"} | config_extra,
        "rate": main_run["rate"],
        "offered": main_run["offered"],
        "summary": main_run["summary"],
        "goodput": {
            "slo": slo.to_json(),
            "vllm_req_s": main_run["vllm_goodput_req_s"],
            "attainment_ttft_tpot": main_run["attainment_ttft_tpot"],
            "distserve": ds,
        },
        "sweep": [{k: v for k, v in r.items() if k != "_records"} for r in runs],
        "_runs": runs,
    }


def save_result(
    result: dict[str, Any], out: str | Path, plots_dir: str | Path | None
) -> list[Path]:
    """Write the JSON (without the in-memory records) and the plots; returns all paths."""
    out = Path(out)
    plots_dir = Path(plots_dir) if plots_dir else out.parent / f"{out.stem}_plots"
    runs = result["_runs"]
    paths = [write_json(out, {k: v for k, v in result.items() if not k.startswith("_")})]
    arms = {f"{r['rate']:.3g} req/s": latency_arrays(r["_records"]) for r in runs}
    paths += plot_latency_cdfs(arms, plots_dir)
    if len(runs) > 1 and runs[0]["attainment_ttft_tpot"] is not None:
        pts = [(r["rate"], r["attainment_ttft_tpot"]) for r in runs]
        paths.append(
            plot_attainment(
                {"this run": pts}, plots_dir / "attainment.png", result["config"].get("target", 0.9)
            )
        )
    return paths


def main(args: argparse.Namespace) -> int:
    try:
        result = run_benchmark(args.addr, args)
    except ValueError as exc:  # bad flags or a malformed trace: name it, no traceback
        raise SystemExit(f"pdserve bench serve: {exc}") from None
    paths = save_result(result, args.out, args.plots)
    g = result["goodput"]
    print(
        format_summary(
            result["summary"],
            {
                "vLLM (req/s meeting all SLOs)": g["vllm_req_s"],
                "DistServe (max rate >= target)": (g["distserve"] or {}).get("interpolated"),
            },
        )
    )
    off = result["offered"]
    print(
        f"offered       {off['num_requests']} requests, "
        f"{off['mean_rate_req_s']:.3f} req/s measured (label {result['rate']})"
    )
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0 if result["summary"]["completed"] else 1
