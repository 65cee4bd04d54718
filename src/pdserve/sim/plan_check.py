"""`plan` checked against emulation: does the configuration `plan` picks have an emulated
goodput within 10 % of the best emulated configuration?

    python -m pdserve.sim.plan_check --model-config llama3-8b \
        --trace /work/shared/data/traces/azure_llm_2023_conv.csv --slo ttft:250 tpot:100 \
        --hardware h100:4 --max-unit 4 --chunks 2048 --decode-seqs 256 --duration 5 \
        --time-scale 5 --out bench-results/plan_check.json

1. `plan` (its search, in process, with `plan`'s own flags) gives its pick and a goodput
   for every candidate unit.
2. Every candidate unit replicated to fill the budget is one configuration
   (`plan_check_configs`: the simulated spec and the `pdserve up` flags of the same cluster).
3. Each configuration's goodput (highest rate with >= `--target` of requests meeting both
   SLOs, `plan_check_search.search_rate` to `--resolution`) is searched in the simulator
   (from `plan`'s unit goodput x replicas) and then on fresh emulated clusters (`pdserve up
   --emulate HW --model-config M --time-scale X`, `evidence_emu.emulated_arm`: every real
   process, the forward pass a timed cost model, measured in modelled time) from the
   simulated answer. Every rate's requests are the simulator's (the trace window replayed
   at that rate), sent to the emulated cluster at their arrival times x X.
4. The verdict compares emulated goodputs per device: plan's pick against the best, and
   the spread (max / min) of the configurations.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench.goodput import SLO
from pdserve.sim.plan_check_configs import Config, configurations, pick_of
from pdserve.sim.plan_check_metrics import run_metrics
from pdserve.sim.plan_check_search import format_table, search_rate, verdict


def parse(argv: list[str]) -> tuple[argparse.Namespace, argparse.Namespace]:
    """(`plan`'s arguments, this check's own)."""
    from pdserve.cli.plan import add_parser

    own = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    own.add_argument(
        "--time-scale", type=float, default=5.0, help="emulation: wall s per modelled s"
    )
    own.add_argument("--resolution", type=float, default=0.1,
                     help="goodput searches stop when failing / passing rate <= 1 + this")  # fmt: skip
    own.add_argument("--tolerance", type=float, default=0.1,
                     help="pass: plan's pick within this of the emulated best")  # fmt: skip
    own.add_argument("--min-spread", type=float, default=1.5)
    own.add_argument("--configs", help="comma-separated configuration names to check "
                     "(default: all; plan's pick is always checked)")  # fmt: skip
    own.add_argument("--max-runs", type=int, default=8, help="most emulated runs per search")
    own.add_argument("--no-emulate", action="store_true", help="simulated searches only")
    own.add_argument("--tokenizer", help="the emulated router's tokenizer (default: built-in)")
    own.add_argument("--help", "-h", action="store_true")
    mine, rest = own.parse_known_args(argv)
    top = argparse.ArgumentParser(prog="python -m pdserve.sim.plan_check")
    add_parser(top.add_subparsers())
    if mine.help:
        own.print_help()
        top.parse_args(["plan", "--help"])
    args = top.parse_args(["plan", *rest])
    if args.out == "results/plan.json":  # plan's default
        args.out = "bench-results/plan_check.json"
    return args, mine


def _name(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", s).strip("-")


def run_check(args: argparse.Namespace, mine: argparse.Namespace, log: Any) -> dict[str, Any]:
    from pdserve.sim.cluster import SimCluster
    from pdserve.sim.evidence_emu import EmuOptions, emulated_arm
    from pdserve.sim.hardware import load_model_config
    from pdserve.sim.plan import Budget, candidates, plan
    from pdserve.sim.run import sim_workload, text_prompt_ids

    budget = Budget.parse(args.hardware, args.prices)
    if len(budget.devices) != 1 or args.network != "nvlink" or args.dtype != "bfloat16":
        raise ValueError("plan_check emulates one hardware type, nvlink, bfloat16 (as `up`)")
    shape = load_model_config(args.model_config)
    args.vocab_size = args.vocab_size or shape.vocab_size
    args.max_model_len = args.max_model_len or shape.max_position_embeddings
    if args.duration is None and args.num_requests is None:
        args.duration = 10.0
    slo = SLO.parse(args.goodput).only("ttft", "tpot")
    t0 = time.perf_counter()
    res = plan(args, budget, args.model_config, args.network, args.dtype, args.target, log)
    plan_s = time.perf_counter() - t0
    cands = candidates(budget, args.model_config, args.network, args.dtype,
                       [int(x) for x in args.chunks.split(",")],
                       [int(x) for x in args.decode_seqs.split(",")], args.max_unit,
                       colocated_modes=args.colocated_modes, kv_dtype=args.kv_dtype)  # fmt: skip
    configs = configurations(cands, res["units"], budget, args.max_model_len, args.block_size)
    pick = pick_of(res, configs)
    if mine.configs:
        keep = {c.strip() for c in mine.configs.split(",")} | {pick.name}
        configs = [c for c in configs if c.name in keep]
    log(f"plan's pick: {pick.name} ({pick.unit} x{pick.replicas}); checking "
        f"{len(configs)} configurations: {', '.join(c.name for c in configs)}")  # fmt: skip

    def requests(rate: float) -> list[Any]:
        return text_prompt_ids(sim_workload(args, rate), args.vocab_size)

    hw = next(iter(budget.devices))
    out_dir = Path(args.out).parent
    opt = EmuOptions(time_scale=mine.time_scale, tokenizer=mine.tokenizer,
                     log_dir=out_dir / f"{Path(args.out).stem}_emu",
                     emulate=("--emulate", hw, "--model-config", args.model_config))  # fmt: skip
    result: dict[str, Any] = {
        "argv": sys.argv[1:], "plan": res, "plan_wall_s": plan_s, "pick": pick.name,
        "time_scale": mine.time_scale, "resolution": mine.resolution, "target": args.target,
        "slo": slo.to_json(), "configs": [], "load_avg_start": os.getloadavg(),
    }  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        out.write_text(json.dumps(result, indent=1, default=str))

    for c in configs:
        row = check_config(c, args, mine, slo, requests, opt, log, SimCluster,
                           emulated_arm, save, result)  # fmt: skip
        log(f"{c.name}: simulated {row['sim_goodput']:.2f} req/s, emulated "
            f"{row['emu_goodput'] or 0:.2f} req/s ({row['devices']} devices)")  # fmt: skip
    rows = result["configs"]
    key = "sim_per_device" if mine.no_emulate else "emu_per_device"  # --no-emulate: a dry run
    v = verdict({r["config"]: r[key] for r in rows}, pick.name, mine.tolerance, mine.min_spread)
    result["verdict_on"] = "simulated" if mine.no_emulate else "emulated"
    result["verdict"] = v.to_json()
    result["table"] = format_table(rows, v, result["verdict_on"])
    result["load_avg_end"] = os.getloadavg()
    result["wall_s"] = time.perf_counter() - t0
    save()
    return result


def check_config(c: Config, args, mine, slo, requests, opt, log, SimCluster,  # type: ignore[no-untyped-def]
                 emulated_arm, save, result) -> dict[str, Any]:  # fmt: skip
    """One configuration: the simulated search, then the emulated one from its answer."""
    row: dict[str, Any] = {"config": c.name, "unit": c.unit, "replicas": c.replicas,
                           "devices": c.devices, "up": c.up, "plan_unit_goodput": c.unit_goodput,
                           "sim_runs": []}  # fmt: skip
    result["configs"].append(row)

    def sim_attain(rate: float) -> float:
        reqs = requests(rate)
        records = SimCluster(c.spec).run([replace(r) for r in reqs])
        run = run_metrics(records, reqs, slo) | {"rate": rate}
        row["sim_runs"].append(run)
        return run["attainment"]

    start = c.unit_goodput * c.replicas or args.start_rate * c.devices
    s = search_rate(sim_attain, start, args.target, mine.resolution)
    row.update(sim_goodput=s.goodput, sim_per_device=s.goodput / c.devices, sim_points=s.points)
    row.update(emu_goodput=None, emu_per_device=None, emu_runs=[])
    if mine.no_emulate:
        save()
        return row

    def emu_attain(rate: float) -> float:
        reqs = requests(rate)
        name = _name(f"{c.name}_{rate:.3f}")
        t = time.perf_counter()
        run = emulated_arm(c.up, reqs, slo, opt, name, metrics=run_metrics) | {"rate": rate}
        row["emu_runs"].append(run)
        save()
        log(f"  emulated {c.name} @ {rate:.2f} req/s ({len(reqs)} requests): attainment "
            f"{run['attainment']:.3f} (TTFT {run['attainment_ttft']:.3f}, TPOT "
            f"{run['attainment_tpot']:.3f}), completed {run['completed']}, step lag "
            f"{run['step_lag'] or 0:.2%}, {time.perf_counter() - t:.0f} s wall, "
            f"load {os.getloadavg()[0]:.1f}")  # fmt: skip
        return run["attainment"]

    e = search_rate(emu_attain, s.goodput or start, args.target, mine.resolution,
                    max_runs=mine.max_runs)  # fmt: skip
    lags = [r["step_lag"] for r in row["emu_runs"] if r.get("step_lag") is not None]
    row.update(emu_goodput=e.goodput, emu_per_device=e.goodput / c.devices, emu_points=e.points,
               step_lag_max=max(lags) if lags else None,
               step_lag_mean=sum(lags) / len(lags) if lags else None)  # fmt: skip
    save()
    return row


def main(argv: list[str] | None = None) -> int:
    args, mine = parse(sys.argv[1:] if argv is None else argv)

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    try:
        result = run_check(args, mine, log)
    except ValueError as exc:
        raise SystemExit(f"plan_check: {exc}") from None
    print(result["table"])
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
