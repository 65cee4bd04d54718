"""`pdserve bench serve --addr HOST:PORT`: open-loop serving benchmark against a running router.

One run at `--rate` (or the trace's own timestamps), or a rate sweep (`--sweep-rates 0.5,1,2`
or `--sweep-rates auto`) for DistServe's goodput. Writes the JSON result and PNG plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench import arrivals
from pdserve.bench.goodput import (
    SLO,
    SweepPoint,
    attainment,
    distserve_goodput,
    search_goodput_rate,
    vllm_goodput,
)
from pdserve.bench.loadgen import open_client, run_load, send_one
from pdserve.bench.metrics import summarize
from pdserve.bench.modelled_time import stretch_arrivals, to_modelled
from pdserve.bench.plots import plot_attainment, plot_latency_cdfs
from pdserve.bench.report import format_summary, latency_arrays, write_json
from pdserve.bench.traces import read_trace
from pdserve.bench.workload import BenchRequest, LengthDist, synthetic_requests, trace_requests


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload, arrival and SLO flags shared by serve and compare."""
    g = p.add_argument_group("workload")
    g.add_argument("--model", help="checkpoint dir: vocab size and context length from config.json")
    g.add_argument("--vocab-size", type=int, help="random token ids are drawn below this")
    g.add_argument("--max-model-len", type=int, help="clip prompt + output to this context")
    g.add_argument("--block-size", type=int, default=16, help="KV block size (Mooncake prefixes)")
    g.add_argument("--trace", help="Azure CSV or Mooncake JSONL trace (read in place)")
    g.add_argument("--trace-format", default="auto", choices=["auto", "azure", "mooncake"])
    g.add_argument(
        "--trace-offset", type=int, default=0, help="skip the trace's first N requests (a window)"
    )
    g.add_argument(
        "--length-scale", type=float, default=1.0, help="scale trace (or --lengths) lengths"
    )
    g.add_argument(
        "--lengths",
        help="length data JSONL(.gz) (pdserve predictor format): real prompts sent as text, "
        "max_tokens = --lengths-model's answer length x --length-scale, ignore_eos",
    )
    g.add_argument("--lengths-model", default="gpt-4-0613", help="whose answer lengths ('any')")
    g.add_argument("--lengths-split", default="val", help="prompt_split to draw from ('' = all)")
    g.add_argument("--max-prompt-chars", type=int, default=1500, help="--lengths: cut prompts")
    g.add_argument("--input-len", default="lognormal:256,0.5", help="synthetic input lengths")
    g.add_argument("--output-len", default="uniform:32,128", help="synthetic output lengths")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals")
    a.add_argument("--rate", type=float, help="req/s (default 1 synthetic; trace: its own times)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument("--time-scale", type=float, default=1.0, help="trace replay: stretch time")
    a.add_argument("--num-requests", type=int, help="number of requests (default 100)")
    a.add_argument(
        "--clock-scale",
        type=float,
        default=1.0,
        help="the cluster is emulated with --time-scale X: stretch arrivals by X and report "
        "every time divided by X (modelled time)",
    )
    a.add_argument("--duration", type=float, help="seconds of arrivals instead of a count")
    s = p.add_argument_group("SLOs and goodput")
    s.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="KEY:MS",
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2e:5000",
    )
    s.add_argument("--sweep-rates", help="comma-separated rates, or 'auto' (bracket + bisect)")
    s.add_argument(
        "--sweep-start", type=float, default=1.0, help="first rate of --sweep-rates auto"
    )
    s.add_argument("--target", type=float, default=0.9, help="DistServe attainment target")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="unmeasured requests sent one by one before the first run",
    )
    p.add_argument("--no-progress", action="store_true")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("serve", help="open-loop serving benchmark against a router")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--out", default="results/serve.json", help="JSON result path")
    p.add_argument("--plots", help="plot directory (default: next to --out)")
    add_workload_args(p)
    p.set_defaults(func=main)


def model_limits(args: argparse.Namespace) -> tuple[int, int | None]:
    """(vocab_size, max_model_len) from the flags, else the model's config.json, else defaults."""
    vocab, max_len = args.vocab_size, args.max_model_len
    if args.model:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        vocab = vocab or cfg.get("vocab_size")
        max_len = max_len or cfg.get("max_position_embeddings")
    return int(vocab or 1000), max_len


WARMUP_SALT = 1000  # the warm-up's prompts differ from every run's


def prompt_seed(args: argparse.Namespace, salt: int) -> int:
    """The seed of run `salt`'s prompt tokens. Every run of a sweep (and the warm-up) gets
    its own prompts: re-sending the same ones would hit the prefix cache of the run before."""
    return args.seed + 7919 * salt


def trace_window(args: argparse.Namespace) -> list[Any]:
    """The trace's records from `--trace-offset` on, at most `--num-requests` of them."""
    skip = getattr(args, "trace_offset", 0) or 0
    if skip < 0:
        raise ValueError(f"--trace-offset must be >= 0, got {skip}")
    limit = skip + args.num_requests if args.num_requests else None
    return read_trace(args.trace, args.trace_format, limit=limit)[skip:]


def base_requests(
    args: argparse.Namespace, n_hint: int | None = None, salt: int = 0
) -> list[BenchRequest]:
    """The workload before arrivals are assigned (trace requests keep the trace's times)."""
    vocab, max_len = model_limits(args)
    seed = prompt_seed(args, salt)
    if getattr(args, "lengths", None):
        from pdserve.bench.lengths import length_requests

        n = n_hint if n_hint is not None else (args.num_requests or 100)
        max_out = max(1, max_len // 2) if max_len else None
        return length_requests(
            args.lengths,
            args.lengths_model,
            n,
            split=args.lengths_split,
            scale=args.length_scale,
            seed=seed,
            max_prompt_chars=args.max_prompt_chars,
            max_output=max_out,
        )
    if args.trace:
        records = trace_window(args)
        return trace_requests(records, vocab, seed, args.length_scale, max_len, args.block_size)
    n = n_hint if n_hint is not None else (args.num_requests or 100)
    return synthetic_requests(
        n, LengthDist.parse(args.input_len), LengthDist.parse(args.output_len), vocab, seed, max_len
    )


def workload_at(
    args: argparse.Namespace,
    rate: float | None,
    salt: int = 0,
    base: list[BenchRequest] | None = None,
) -> list[BenchRequest]:
    """Requests with arrival times for one run at `rate` (None: the default rate). `base`:
    the trace's `base_requests(args, salt=salt)` when the caller already has them (the
    simulator replays one trace at many rates)."""
    if args.trace:
        reqs = base if base is not None else base_requests(args, salt=salt)
        stamps = [r.arrival_s for r in reqs]
        if rate is not None and args.duration:
            # rescale the window actually replayed, not the whole file (issue 12, item 6)
            n, times = arrivals.replay_window(stamps, rate, args.duration)
            reqs = reqs[:n]
        else:
            times = arrivals.replay_arrivals(stamps, args.time_scale, rate)
        out = [replace(r, arrival_s=t) for r, t in zip(reqs, times, strict=True)]
        if args.duration:
            out = [r for r in out if r.arrival_s < args.duration]
        return out
    rate = rate or args.rate or 1.0
    if args.duration:
        times = arrivals.arrivals_for_duration(args.duration, rate, args.burstiness, args.seed)
    else:
        times = arrivals.gamma_arrivals(args.num_requests or 100, rate, args.burstiness, args.seed)
    reqs = base_requests(args, n_hint=len(times), salt=salt)
    return [replace(r, arrival_s=t) for r, t in zip(reqs, times, strict=True)]


def offered_rate(reqs: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    """What was actually offered: n requests, their mean rate (n - 1) / span and, for a
    duration-bounded run, n / duration. Recorded with every run so a label cannot lie."""
    times = sorted(r.arrival_s for r in reqs)
    duration = getattr(args, "duration", None)
    return {
        "num_requests": len(times),
        "span_s": (times[-1] - times[0]) if times else 0.0,
        "mean_rate_req_s": arrivals.mean_rate(times),
        "per_duration_req_s": (len(times) / duration) if duration else None,
    }


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


def run_benchmark(addr: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run, or a sweep; returns the JSON-ready result (runs keep their records)."""
    slo = SLO.parse(args.goodput)
    if args.warmup > 0:
        warm = [
            replace(r, arrival_s=0.0, max_tokens=min(r.max_tokens, 4))
            for r in base_requests(args, n_hint=args.warmup, salt=WARMUP_SALT)[: args.warmup]
        ]
        asyncio.run(_warmup(addr, warm, args.temperature))
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
