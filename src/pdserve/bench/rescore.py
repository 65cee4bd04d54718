"""`pdserve bench rescore RESULT.json --goodput ttft:MS tpot:MS`: score a saved `serve` or
`compare` result under other SLOs, from the per-request records it kept (no new run).

For a sensitivity table: how each arm's goodput moves as the SLOs tighten or loosen. The run
itself is unchanged, so the SLOs the run was launched with stay the headline figures."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pdserve.workload.goodput import SLO, SweepPoint, attainment, distserve_goodput
from pdserve.workload.metrics import RequestRecord


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("rescore", help="score a saved result under other SLOs")
    p.add_argument("result", help="JSON written by `bench serve --out` or `bench compare --out`")
    p.add_argument(
        "--goodput", nargs="+", action="append", required=True, metavar="KEY:MS",
        help="an SLO set, e.g. ttft:1000 tpot:25 (repeat --goodput for several sets)",
    )  # fmt: skip
    p.add_argument("--target", type=float, default=0.9, help="DistServe attainment target")
    p.set_defaults(func=main)


def arms_of(result: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """arm name -> its sweep runs (each with `rate` and `records`)."""
    if "arms" in result:
        return {name: arm["sweep"] for name, arm in result["arms"].items()}
    return {"run": result["sweep"]}


def rescore(result: dict[str, Any], slo: SLO, target: float) -> dict[str, dict[str, Any]]:
    """Per arm: attainment of both TTFT and TPOT at each rate, and DistServe's goodput."""
    out = {}
    for name, runs in arms_of(result).items():
        points = []
        for run in runs:
            records = [RequestRecord.from_json(r) for r in run["records"]]
            points.append(SweepPoint(run["rate"], attainment(records, slo)))
        out[name] = {
            "attainment": {p.rate: p.attainment for p in points},
            "distserve": distserve_goodput(points, target),
        }
    return out


def main(args: argparse.Namespace) -> int:
    result = json.loads(Path(args.result).read_text())
    for items in args.goodput:
        slo = SLO.parse(items).only("ttft", "tpot")
        scored = rescore(result, slo, args.target)
        print(f"SLO {' '.join(items)} (target {args.target:.0%} of requests meeting both)")
        for name, res in scored.items():
            att = "  ".join(f"{r:g}:{a:.2f}" for r, a in res["attainment"].items())
            ds = res["distserve"]
            rate = "-" if ds["max_rate"] is None else f"{ds['interpolated']:.2f}"
            print(f"  {name:>10}  goodput {rate:>6} req/s   attainment by rate  {att}")
    return 0
