"""`plan` checked against emulation: does the configuration `plan` picks have an emulated
goodput within 10 % of the best emulated configuration?

    python -m benchmarks.plan_check --model-config llama3-8b \
        --trace /work/shared/data/traces/azure_llm_2023_conv.csv --slo ttft:250 tpot:100 \
        --hardware h100:4 --max-unit 4 --chunks 2048 --decode-seqs 256 --duration 5 \
        --time-scale 5 --out bench-results/plan_check.json

1. `plan` (its search, in process, with `plan`'s own flags) gives its pick and a goodput
   for every candidate unit.
2. Every candidate unit replicated to fill the budget is one configuration
   (`configs.py`: the simulated spec and the `pdserve up` flags of the same cluster).
3. Each configuration's goodput (highest rate with >= `--target` of requests meeting both
   SLOs, `search.search_rate` to `--resolution`) is searched in the simulator
   (from `plan`'s unit goodput x replicas) and then on fresh emulated clusters (`pdserve up
   --emulate HW --model-config M --time-scale X`, `benchmarks.evidence.emulated.emulated_arm`: every real
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
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.evidence.emulated import EmuOptions, emulated_arm
from benchmarks.plan_check.configs import Config, configurations, pick_of
from benchmarks.plan_check.metrics import pair_errors, run_metrics
from benchmarks.plan_check.search import format_table, search_rate, verdict
from pdserve.sim.cluster import SimCluster
from pdserve.sim.run import sim_workload, text_prompt_ids
from pdserve.workload.goodput import SLO


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
    own.add_argument("--configs-only", action="store_true",
                     help="check only --configs, not plan's pick as well")  # fmt: skip
    own.add_argument("--max-runs", type=int, default=8,
                     help="most emulated runs per search (1: one run at the simulated goodput, "
                     "a check of the simulator's metrics there)")  # fmt: skip
    own.add_argument("--max-lag", type=float, default=0.02,
                     help="an emulated run whose step lag or gap exceeds this is repeated")  # fmt: skip
    own.add_argument("--repeats", type=int, default=3, help="most tries of one emulated rate")
    own.add_argument("--no-emulate", action="store_true", help="simulated searches only")
    own.add_argument("--tokenizer", help="the emulated router's tokenizer (default: built-in)")
    own.add_argument("--help", "-h", action="store_true")
    mine, rest = own.parse_known_args(argv)
    top = argparse.ArgumentParser(prog="python -m benchmarks.plan_check")
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


def run_check(args: argparse.Namespace, mine: argparse.Namespace, log: Any,
              argv: list[str] | None = None) -> dict[str, Any]:  # fmt: skip
    from pdserve.costmodel.shapes import load_model_config
    from pdserve.sim.candidates import Budget, candidates
    from pdserve.sim.plan import plan

    budget = Budget.parse(args.hardware, args.prices)
    if args.network != "nvlink" or args.dtype != "bfloat16":
        raise ValueError("nvlink and bfloat16 only (what `up --emulate` models)")
    shape = load_model_config(args.model_config)
    args.vocab_size = args.vocab_size or shape.vocab_size
    args.max_model_len = args.max_model_len or shape.max_position_embeddings
    if args.duration is None and args.num_requests is None:
        args.duration = 10.0
    t0 = time.perf_counter()
    res = plan(args, budget, args.model_config, args.network, args.dtype, args.target, log)
    plan_s = time.perf_counter() - t0
    cands = candidates(budget, args.model_config, args.network, args.dtype,
                       [int(x) for x in args.chunks.split(",")],
                       [int(x) for x in args.decode_seqs.split(",")], args.max_unit,
                       colocated_modes=args.colocated_modes or "chunked", kv_dtype=args.kv_dtype)  # fmt: skip
    configs = configurations(cands, res["units"], budget, args.max_model_len, args.block_size)
    pick = pick_of(res, configs)
    if mine.configs:
        keep = {c.strip() for c in mine.configs.split(",")}
        keep |= set() if mine.configs_only else {pick.name}
        configs = [c for c in configs if c.name in keep]
    log(f"plan's pick: {pick.name} ({pick.unit} x{pick.replicas}); checking "
        f"{len(configs)} configurations: {', '.join(c.name for c in configs)}")  # fmt: skip
    check = Checker(args, mine, log)
    check.result.update(argv=argv, plan=res, plan_wall_s=plan_s, pick=pick.name)
    for c in configs:
        row = check.config(c)
        log(f"{c.name}: simulated {row['sim_goodput']:.2f} req/s, emulated "
            f"{row['emu_goodput'] or 0:.2f} req/s ({row['devices']} devices)")  # fmt: skip
    result = check.result
    on = "simulated" if mine.no_emulate else "emulated"  # --no-emulate: a dry run
    result.update(load_avg_end=os.getloadavg(), wall_s=time.perf_counter() - t0)
    if any(r["config"] == pick.name for r in result["configs"]):
        v = verdict({r["config"]: r[f"{on[:3]}_per_device"] for r in result["configs"]},
                    pick.name, mine.tolerance, mine.min_spread)  # fmt: skip
        result.update(verdict_on=on, verdict=v.to_json(),
                      table=format_table(result["configs"], v, on))  # fmt: skip
    else:  # --configs-only without the pick: the simulator's metrics against emulation
        result["table"] = "\n".join(
            f"{r['config']}: simulated goodput {r['sim_goodput']:.2f} req/s; emulated at "
            f"{e['rate']:.2f} req/s: attainment {e['attainment']:.3f} (simulated "
            f"{e['vs_sim']['sim']['attainment']:.3f}), largest metric error "
            f"{e['vs_sim']['max_rel_error'] or 0:.1%}"
            for r in result["configs"] for e in r["emu_runs"])  # fmt: skip
    check.save()
    return result


class Checker:
    """Each configuration's simulated, then emulated, goodput search; every run is saved
    to `--out` as it ends (a long check can be cut)."""

    def __init__(self, args: argparse.Namespace, mine: argparse.Namespace,
                 log: Callable[[str], None]) -> None:  # fmt: skip
        self.args, self.mine, self.log = args, mine, log
        self.slo = SLO.parse(args.goodput).only("ttft", "tpot")
        self.out = Path(args.out)
        self.opt = EmuOptions(time_scale=mine.time_scale, tokenizer=mine.tokenizer,
                              log_dir=self.out.parent / f"{self.out.stem}_emu",
                              emulate=("--model-config", args.model_config))  # fmt: skip
        self.result: dict[str, Any] = {
            "time_scale": mine.time_scale, "resolution": mine.resolution,
            "target": args.target, "slo": self.slo.to_json(), "configs": [],
            "load_avg_start": os.getloadavg(),
        }  # fmt: skip

    def save(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps(self.result, indent=1, default=str))

    def requests(self, rate: float) -> list[Any]:
        """The simulator's requests at `rate` (both sides run these)."""
        return text_prompt_ids(sim_workload(self.args, rate), self.args.vocab_size)

    def config(self, c: Config) -> dict[str, Any]:
        """One configuration: the simulated search, then the emulated one from its answer."""
        args, mine = self.args, self.mine
        row: dict[str, Any] = {"config": c.name, "unit": c.unit, "replicas": c.replicas,
                               "devices": c.devices, "up": c.up,
                               "plan_unit_goodput": c.unit_goodput, "sim_runs": [],
                               "emu_goodput": None, "emu_per_device": None, "emu_runs": []}  # fmt: skip
        self.result["configs"].append(row)

        def sim_attain(rate: float) -> float:
            return self._simulated(c, row, rate)["attainment"]

        start = c.unit_goodput * c.replicas or args.start_rate * c.devices
        s = search_rate(sim_attain, start, args.target, mine.resolution)
        row.update(sim_goodput=s.goodput, sim_per_device=s.goodput / c.devices,
                   sim_points=s.points)  # fmt: skip
        self.save()
        if mine.no_emulate:
            return row
        e = search_rate(lambda rate: self._emulated(c, row, rate), s.goodput or start,
                        args.target, mine.resolution, max_runs=mine.max_runs)  # fmt: skip
        lags = [r["step_lag"] for r in row["emu_runs"] if r.get("step_lag") is not None]
        errs = [r["vs_sim"]["max_rel_error"] for r in row["emu_runs"]
                if r["vs_sim"]["max_rel_error"] is not None]  # fmt: skip
        row["vs_sim_max_rel_error"] = max(errs) if errs else None
        row.update(emu_goodput=e.goodput, emu_per_device=e.goodput / c.devices,
                   emu_points=e.points, step_lag_max=max(lags) if lags else None,
                   step_lag_mean=sum(lags) / len(lags) if lags else None)  # fmt: skip
        self.save()
        return row

    def _simulated(self, c: Config, row: dict[str, Any], rate: float) -> dict[str, Any]:
        """One simulated run of `c` at `rate` (kept in the row's sim_runs)."""
        reqs = self.requests(rate)
        records = SimCluster(c.spec).run([replace(r) for r in reqs])
        run = run_metrics(records, reqs, self.slo) | {"rate": rate}
        row["sim_runs"].append(run)
        return run

    def _emulated(self, c: Config, row: dict[str, Any], rate: float) -> float:
        """One emulated run of `c` at `rate` on a fresh cluster; its attainment. A run whose
        engines fell behind their modelled time (step lag or gap over `--max-lag`: other
        processes took the cores) ran a slower machine than the one modelled: it is kept
        aside (`emu_rejected`) and repeated, at most `--repeats` times in all."""
        reqs = self.requests(rate)
        for attempt in range(1, self.mine.repeats + 1):
            t = time.perf_counter()
            run = emulated_arm(c.up, reqs, self.slo, self.opt,
                               _name(f"{c.name}_{rate:.3f}_{attempt}"), metrics=run_metrics)  # fmt: skip
            run |= {"rate": rate, "load_avg": os.getloadavg()[0], "attempt": attempt}
            behind = max(run.get("step_lag") or 0.0, run.get("step_gap") or 0.0)
            if behind <= self.mine.max_lag or attempt == self.mine.repeats:
                break
            row.setdefault("emu_rejected", []).append(run)
            self.save()
            self.log(f"  emulated {c.name} @ {rate:.2f} req/s: step lag {behind:.1%} > "
                     f"{self.mine.max_lag:.1%} (load {run['load_avg']:.1f}): repeating")  # fmt: skip
        row["emu_runs"].append(run)
        sim = next((r for r in row["sim_runs"] if r["rate"] == rate), None)
        run["vs_sim"] = pair_errors(sim or self._simulated(c, row, rate), run)
        self.save()
        self.log(f"  emulated {c.name} @ {rate:.2f} req/s ({len(reqs)} requests): attainment "
                 f"{run['attainment']:.3f} (TTFT {run['attainment_ttft']:.3f}, TPOT "
                 f"{run['attainment_tpot']:.3f}), completed {run['completed']}, step lag "
                 f"{run['step_lag'] or 0:.2%}, {time.perf_counter() - t:.0f} s wall, "
                 f"load {run['load_avg']:.1f}")  # fmt: skip
        return run["attainment"]


def main(argv: list[str] | None = None) -> int:
    args, mine = parse(sys.argv[1:] if argv is None else argv)

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    try:
        result = run_check(args, mine, log, sys.argv[1:] if argv is None else argv)
    except ValueError as exc:
        raise SystemExit(f"plan_check: {exc}") from None
    print(result["table"])
    print(f"wrote {args.out}")
    return 0
