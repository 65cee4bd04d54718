"""`pdserve bench compare`: several arms back to back on the same workload, seed and cores.

Each arm starts a fresh `pdserve up <flags>` cluster, runs `bench serve`'s benchmark against
it, and stops it (SIGTERM, wait). The ratio table (numerator arm / denominator arm) is printed
and saved with every arm's result; plots have one line per arm.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
from pathlib import Path
from typing import Any

from pdserve.bench.cluster import UpProcess
from pdserve.bench.plots import plot_attainment, plot_latency_cdfs
from pdserve.bench.report import (
    format_ratio_table,
    format_summary,
    latency_arrays,
    ratio_table,
    write_json,
)
from pdserve.bench.serve import run_benchmark
from pdserve.workload.spec import add_workload_args

DEFAULT_ARMS = {
    "colocated": "--mode colocated --colocated 2 --pin-cpus",
    "disagg": "--mode disagg --prefill 1 --decode 1 --pin-cpus",
}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("compare", help="benchmark arms on fresh clusters, back to back")
    p.add_argument(
        "--arms",
        default="colocated,disagg",
        help=f"comma-separated arms; known: {', '.join(DEFAULT_ARMS)}; "
        "or NAME=FLAGS pairs separated by ';'",
    )
    p.add_argument(
        "--ratio",
        help="NUM/DEN arm names for the ratio table (default disagg/colocated, else second/first)",
    )
    p.add_argument("--port", type=int, default=0, help="router port per arm (0 = any free)")
    p.add_argument("--up-args", default="", help="extra flags for every `pdserve up`")
    p.add_argument("--ready-timeout", type=float, default=600.0)
    p.add_argument(
        "--concurrent",
        action="store_true",
        help="run the arms at the same time (all clusters up, same workload, same moment)",
    )
    p.add_argument("--out", default="results/compare.json")
    p.add_argument("--plots", help="plot directory (default: next to --out)")
    add_workload_args(p)
    p.set_defaults(func=main)


def parse_arms(spec: str) -> dict[str, list[str]]:
    """ "colocated,disagg" or "a=--mode colocated --colocated 2; b=--mode disagg"."""
    arms: dict[str, list[str]] = {}
    parts = [s.strip() for s in (spec.split(";") if "=" in spec else spec.split(",")) if s.strip()]
    for part in parts:
        name, eq, flags = part.partition("=")
        name = name.strip()
        if eq:
            arms[name] = shlex.split(flags)
        elif name in DEFAULT_ARMS:
            arms[name] = shlex.split(DEFAULT_ARMS[name])
        else:
            raise ValueError(f"unknown arm {name!r}: known {sorted(DEFAULT_ARMS)} or NAME=FLAGS")
    if not arms:
        raise ValueError("no arms given")
    return arms


def _arm_args(args: Any, flags: list[str]) -> Any:
    """An emulated arm with `--time-scale X` is benchmarked in modelled time."""
    import argparse

    from pdserve.bench.modelled_time import time_scale_of

    arm = argparse.Namespace(**vars(args))
    arm.clock_scale = time_scale_of(flags)
    return arm


def pick_ratio(names: list[str], spec: str | None) -> tuple[str, str] | None:
    if spec:
        num, _, den = spec.partition("/")
        if num not in names or den not in names:
            raise ValueError(f"--ratio {spec!r}: both must be among the arms {names}")
        return num, den
    if "disagg" in names and "colocated" in names:
        return "disagg", "colocated"
    return (names[1], names[0]) if len(names) >= 2 else None


def _cluster(name: str, flags: list[str], extra: list[str], args, out: Path) -> UpProcess:
    print(f"== arm {name}: pdserve up {shlex.join(flags + extra)}", flush=True)
    return UpProcess(
        flags + extra,
        port=args.port,
        ready_timeout_s=args.ready_timeout,
        log_path=out.parent / f"{out.stem}_{name}_up.log",
    )


def _with_counters(result: dict[str, Any], addr: str, tls_dir: str | None) -> dict[str, Any]:
    try:
        from pdserve.bench.lengths import cluster_preemptions

        result["preemptions"] = cluster_preemptions(addr, tls_dir)
    except Exception as exc:  # reporting only: never fail the arm for it
        print(f"(preemption counters unavailable: {exc})", flush=True)
    return result


def _run_back_to_back(arms, extra, args, out: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    for name, flags in arms.items():
        cluster = _cluster(name, flags, extra, args, out)
        with cluster as addr:
            res = run_benchmark(addr, _arm_args(args, flags))
            results[name] = _with_counters(res, addr, cluster.tls_dir)
        print(format_summary(results[name]["summary"]), flush=True)
    return results


def _run_concurrently(arms, extra, args, out: Path) -> dict[str, dict[str, Any]]:
    """Every arm's cluster up at once, the same workload sent to all of them at the same
    time (one thread each): on a shared, noisy machine the arms see the same load, which
    back-to-back runs minutes apart do not. Each arm gets a share of the cores."""
    from concurrent.futures import ThreadPoolExecutor

    with contextlib.ExitStack() as stack:
        clusters = {n: _cluster(n, f, extra, args, out) for n, f in arms.items()}
        addrs = {n: stack.enter_context(c) for n, c in clusters.items()}
        with ThreadPoolExecutor(len(addrs)) as pool:
            futures = {
                n: pool.submit(run_benchmark, a, _arm_args(args, arms[n])) for n, a in addrs.items()
            }
            results = {n: f.result() for n, f in futures.items()}
        for n, a in addrs.items():
            _with_counters(results[n], a, clusters[n].tls_dir)
            print(f"== arm {n}\n" + format_summary(results[n]["summary"]), flush=True)
    return results


def main(args: argparse.Namespace) -> int:
    try:
        arms = parse_arms(args.arms)
        ratio = pick_ratio(list(arms), args.ratio)
    except ValueError as exc:
        raise SystemExit(f"pdserve bench compare: {exc}") from None
    out = Path(args.out)
    plots_dir = Path(args.plots) if args.plots else out.parent / f"{out.stem}_plots"
    extra = shlex.split(args.up_args) + (["--model", args.model] if args.model else [])
    results = (
        _run_concurrently(arms, extra, args, out)
        if args.concurrent
        else _run_back_to_back(arms, extra, args, out)
    )

    saved: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "arms": {
            n: {"up_args": arms[n] + extra} | {k: v for k, v in r.items() if not k.startswith("_")}
            for n, r in results.items()
        },
    }
    if ratio:
        rows = ratio_table(saved["arms"], *ratio)
        saved["ratio"] = {"numerator": ratio[0], "denominator": ratio[1], "rows": rows}
        print(f"\n== {ratio[0]} / {ratio[1]}")
        print(format_ratio_table(rows, *ratio))
        from pdserve.bench.lengths import wait_vs

        base = next(x for x in results[ratio[1]]["_runs"] if x["rate"] == results[ratio[1]]["rate"])
        waits = {}
        for n, r in results.items():
            head = next(x for x in r["_runs"] if x["rate"] == r["rate"])
            waits[n] = wait_vs(head["_records"], base["_records"])
        saved["ratio"]["ttft_vs_denominator"] = waits
        print(f"TTFT per request vs {ratio[1]}: {waits}")
    paths = [write_json(out, saved)]
    # CDFs of each arm's headline run; attainment curves when arms were swept
    heads = {n: next(x for x in r["_runs"] if x["rate"] == r["rate"]) for n, r in results.items()}
    paths += plot_latency_cdfs(
        {n: latency_arrays(h["_records"]) for n, h in heads.items()}, plots_dir
    )
    curves = {
        n: [(x["rate"], x["attainment_ttft_tpot"]) for x in r["_runs"]]
        for n, r in results.items()
        if r["_runs"][0]["attainment_ttft_tpot"] is not None
    }
    if curves:
        paths.append(plot_attainment(curves, plots_dir / "attainment.png", args.target))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0
