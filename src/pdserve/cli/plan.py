"""`pdserve plan --trace F --slo ttft:MS tpot:MS --model-config C --hardware h100:16`:
search colocated and disaggregated M:N configurations by simulation (pdserve.sim.plan)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    from pdserve.cli.plan_map import add_map_args
    from pdserve.workload.spec import add_workload_args

    p = subparsers.add_parser("plan", help="how many prefill/decode instances, by simulation")
    p.add_argument("--slo", dest="goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="SLOs in ms: ttft:MS tpot:MS (same as --goodput)")  # fmt: skip
    p.add_argument("--model-config", required=True,
                   help="config.json path/dir or built-in: llama3-8b, llama3-70b, qwen2.5-32b")  # fmt: skip
    p.add_argument("--hardware", default="h100:16", help="NAME[xTP]:COUNT[,NAME:COUNT]")
    p.add_argument("--prices", help="$ per device-hour, e.g. h100=2.5,l40s=0.9")
    p.add_argument("--network", default="nvlink", help="KV link: nvlink, ib, eth100, ...")
    p.add_argument("--dtype", default="bfloat16", help="the weights' dtype")
    p.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "fp8", "int8"],
                   help="the KV cache's dtype (default: --dtype); fp8/int8 halve KV bytes")  # fmt: skip
    p.add_argument("--chunks", default="2048,8192", help="prefill token budgets to try")
    p.add_argument("--decode-seqs", default="256", help="decode batch caps to try")
    p.add_argument("--max-unit", type=int, default=6, help="largest M + N of a disagg unit")
    p.add_argument("--start-rate", type=float, default=8.0, help="first rate per device (req/s)")
    p.add_argument("--colocated-modes",
                   help="colocated schedulers to try: chunked (this engine), nochunk (vLLM <= 0.3: "
                   "prefill priority, whole prompts), or chunked,nochunk (default: chunked; "
                   "--map: both)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=0,
                   help="processes for the simulations (0 = one per CPU); the answer is the same")  # fmt: skip
    p.add_argument("--out", default="results/plan.json")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_workload_args(p)
    add_map_args(p)
    p.set_defaults(func=main)


def _cpu_s() -> float:
    import resource

    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def _fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def main(args: argparse.Namespace) -> int:
    from pdserve.bench.plots import plot_attainment
    from pdserve.bench.report import write_json
    from pdserve.costmodel.shapes import load_model_config
    from pdserve.sim.candidates import Budget
    from pdserve.sim.plan import plan

    try:
        budget = Budget.parse(args.hardware, args.prices)
        shape = load_model_config(args.model_config)
    except ValueError as exc:
        raise SystemExit(f"pdserve plan: {exc}") from None
    if not args.vocab_size and not args.model:
        args.vocab_size = shape.vocab_size
    if args.duration is None and args.num_requests is None:
        args.duration = 60.0
    if args.map:
        from pdserve.cli.plan_map import main_map

        if args.out == "results/plan.json":
            args.out = "results/plan_map.json"
        return main_map(args, budget)

    def log(m):
        return print(m, file=sys.stderr, flush=True)

    try:
        t0, c0 = time.perf_counter(), _cpu_s()
        res = plan(args, budget, args.model_config, args.network, args.dtype, args.target, log)
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        res["cpu_s"] = round(_cpu_s() - c0, 1)  # this process and its workers
        log(f"search took {res['wall_s']} s wall, {res['cpu_s']} s CPU")
    except ValueError as exc:
        raise SystemExit(f"pdserve plan: {exc}") from None
    out = Path(args.out)
    best = res["best"]
    plot_units = {u["label"]: u["points"] for u in res["units"]
                  if any(u["label"] == b["unit"] for b in best.values())}  # fmt: skip
    plot_all = plot_attainment({u["label"]: u["points"] for u in res["units"]},
                               out.parent / f"{out.stem}_attainment_all.png", args.target)  # fmt: skip
    plot_best = plot_attainment(plot_units, out.parent / f"{out.stem}_attainment_best.png",
                                args.target)  # fmt: skip
    res["plots"] = [str(plot_all), str(plot_best)]
    path = write_json(out, res | {"config": {k: v for k, v in vars(args).items() if k != "func"}})
    if args.json:
        keys = ("best", "best_overall", "disagg_over_colocated_per_device",
                "disagg_over_colocated_nochunk_per_device", "cost_ranking", "wall_s")  # fmt: skip
        json.dump({k: res.get(k) for k in keys},
                  sys.stdout, indent=1, default=str)  # fmt: skip
        print()
        return 0
    print(f"model {res['model']} ({res['dtype']}, KV {res['kv_dtype']}), budget {res['budget']}, network {res['network']}, "
          f"SLO {res['slo']} at {res['target']:.0%}")  # fmt: skip
    head = f"{'unit':<52}{'goodput':>9}{'/device':>9}{'$/M out':>9}"
    print(head)
    print("-" * len(head))
    for u in sorted(res["units"], key=lambda u: -u["per_device_goodput"]):
        print(f"{u['label']:<52}{u['goodput_req_s']:>9.2f}{u['per_device_goodput']:>9.2f}"
              f"{_fmt(u['cost_per_m_output_tokens']):>9}")  # fmt: skip
    if res["prices"]:
        print()
        print("ranked by cost per goodput (units, and the best of each kind at full scale):")
        head = f"{'configuration':<58}{'req/s':>9}{'$/h':>8}{'$/h per req/s':>15}{'$/M out':>9}"
        print(head)
        print("-" * len(head))
        for r in res["cost_ranking"]:
            print(f"{r['label']:<58}{r['goodput_req_s']:>9.2f}{_fmt(r['usd_per_hour']):>8}"
                  f"{_fmt(r['usd_per_hour_per_req_s'], '.3f'):>15}"
                  f"{_fmt(r['cost_per_m_output_tokens']):>9}")  # fmt: skip
    print()
    for kind, b in best.items():
        fs = b["full_scale"] or {}
        print(f"best {kind:<9}: {b['unit']} x{b['replicas']} = {b['instances']} on {b['devices']}: "
              f"{b['goodput_req_s']:.1f} req/s ({b['per_device_goodput']:.2f}/device), "
              f"$/M out {_fmt(b['cost_per_m_output_tokens'])}; at full scale: attainment "
              f"{_fmt(fs.get('attainment'), '.1%')}, TTFT p50/p90 {_fmt(fs.get('ttft_p50_ms'), '.0f')}/"
              f"{_fmt(fs.get('ttft_p90_ms'), '.0f')} ms, TPOT p50/p90 {_fmt(fs.get('tpot_p50_ms'), '.1f')}/"
              f"{_fmt(fs.get('tpot_p90_ms'), '.1f')} ms")  # fmt: skip
    r = res["disagg_over_colocated_per_device"]
    print(f"per-device goodput, best disagg / best colocated: {_fmt(r)}")
    if res.get("disagg_over_colocated_nochunk_per_device") is not None:
        r = res["disagg_over_colocated_nochunk_per_device"]
        print(f"per-device goodput, best disagg / best colocated without chunking: {_fmt(r)}")
    print(f"wrote {path}, {plot_all}, {plot_best}")
    return 0
