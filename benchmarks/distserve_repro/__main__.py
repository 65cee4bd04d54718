"""Entry point: see the package docstring."""

from __future__ import annotations

import argparse
import csv
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.distserve_repro.arms import (
    ARMS,
    EXTENSIONS,
    TARGET,
    TPOT_MS,
    TTFT_MS,
    Arm,
    goodput,
    our_attainment,
)
from benchmarks.distserve_repro.workload import Workload, sharegpt_like, write_distserve_workload

PUBLISHED = Path(__file__).resolve().parent.parent / "published" / "distserve_repro.json"
THEIRS_CMD = ("python -m simdistserve.benchmarks.simulate_dist --backend {backend} "
              "--model facebook/opt-13b --workload {workload} --arrival custom --N {n} "
              "--tp-prefill {tp_prefill} --tp-decode {tp_decode} --prefill-target {ttft:g} "
              "--decode-target {tpot:g} --slas '[]' --slo-scales '[1]' "
              "--output-request-latency {out}")  # fmt: skip


def _rate_key(r: float) -> str:
    return f"{r:.2f}"


def their_attainment(arm: Arm, w: Workload, rate: float, pkg: Path, python: str) -> float:
    """Joint attainment of `arm` at per-GPU `rate` in DistServe's simulator (a subprocess:
    its own CLI, its own environment), on the same request list."""
    with tempfile.TemporaryDirectory() as tmp:
        wl, out = Path(tmp) / "workload.json", Path(tmp) / "latency.csv"
        write_distserve_workload(w, rate * arm.gpus, wl)
        backend = "distserve" if arm.mode == "disagg" else "vllm"
        cmd = THEIRS_CMD.format(backend=backend, workload=wl, n=len(w.pairs),
                                tp_prefill=arm.tp_prefill, tp_decode=arm.tp_decode,
                                ttft=TTFT_MS, tpot=TPOT_MS, out=out)  # fmt: skip
        subprocess.run([python, *shlex.split(cmd)[1:]], cwd=pkg, check=True,
                       capture_output=True)  # fmt: skip
        with open(out) as fh:
            rows = list(csv.DictReader(fh))
    ok = sum(float(r["first_token_latency"]) <= TTFT_MS and float(r["tpot"]) <= TPOT_MS
             for r in rows)  # fmt: skip
    return ok / len(w.pairs)


def run_theirs(
    checkout: Path, python: str, n: int, seed: int, sigmas: tuple[float, ...]
) -> dict[str, Any]:
    """Every reproduced arm's goodput search in DistServe's simulator. The arm with the vLLM
    cluster and DistServe's coefficients runs from a copy of the package whose vLLM profile
    is the DistServe one."""
    w = sharegpt_like(n, seed, (sigmas[0], sigmas[1]))
    curves: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        same = Path(tmp) / "samecoef"
        shutil.copytree(checkout / "simdistserve", same / "simdistserve")
        prof = same / "simdistserve" / "estimators" / "profile_data"
        shutil.copy(prof / "profiler-a100-80g.distserve.json", prof / "profiler-a100-80g.vllm.json")
        for arm in ARMS:
            pkg = same if (arm.mode == "colocated" and arm.engine == "distserve") else checkout
            g, seen = goodput(lambda r, a=arm, p=pkg: their_attainment(a, w, r, p, python))
            curves[arm.name] = {_rate_key(r): round(a, 4) for r, a in sorted(seen.items())}
            print(f"{arm.name}: {g:.3f} per GPU", file=sys.stderr)
    return curves


def _arm_row(arm: Arm, w: Workload, theirs_curve: dict[str, float] | None) -> dict[str, Any]:
    ours, seen = goodput(lambda r: our_attainment(arm, w, r, "opt-13b"))
    row: dict[str, Any] = {"arm": arm.name, "what": arm.what, "gpus": arm.gpus,
                           "ours_per_gpu": round(ours, 3),
                           "ours_curve": {_rate_key(r): round(a, 4)
                                          for r, a in sorted(seen.items())}}  # fmt: skip
    if theirs_curve and arm.reproduced:
        pts = {round(float(k), 6): v for k, v in theirs_curve.items()}
        theirs, _ = goodput(lambda r: pts[round(r, 6)])
        row["theirs_per_gpu"] = round(theirs, 3)
        row["rel_error"] = round((ours - theirs) / theirs, 4)
    return row


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every stored workload's reproduced arms (and, with --extensions, the extensions on
    the first workload): ours searched now, theirs from the stored curves."""
    pub = json.loads(PUBLISHED.read_text())
    wanted = set(args.arms.split(",")) if args.arms else None
    out = []
    for i, spec in enumerate(pub["workloads"]):
        w = sharegpt_like(spec["n"], spec["seed"], tuple(spec["sigmas"]))
        arms = [*ARMS, *(EXTENSIONS if args.extensions and i == 0 else ())]
        rows = [_arm_row(a, w, spec["theirs"].get(a.name))
                for a in arms if wanted is None or a.name in wanted]  # fmt: skip
        out.append({"workload": w.describe(), "arms": rows})
    errs = [abs(r["rel_error"]) for o in out for r in o["arms"] if "rel_error" in r]
    return {"command": "python -m benchmarks.distserve_repro " + " ".join(sys.argv[1:]),
            "slo": {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS, "attainment": TARGET},
            "workloads": out, "paper": pub["paper"],
            "max_rel_error": max(errs) if errs else None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--extensions", action="store_true", help="also chunked prefill, KV links")
    ap.add_argument("--arms", help="comma-separated arm names (default: all)")
    ap.add_argument(
        "--run-theirs",
        type=Path,
        metavar="CHECKOUT",
        help="a DistServe checkout: run its simulator, print its curves",
    )
    ap.add_argument(
        "--their-python",
        default=sys.executable,
        help="the Python of DistServe's environment (simpy, pandas)",
    )
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sigmas", default="0.5,0.8", help="--run-theirs: log-normal spreads IN,OUT")
    args = ap.parse_args(argv)
    if args.run_theirs:
        sig = tuple(float(x) for x in args.sigmas.split(","))
        curves = run_theirs(args.run_theirs, args.their_python, args.n, args.seed, sig)
        print(json.dumps(curves, indent=1))
        return 0
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    for wl in res["workloads"]:
        print(f"workload: {wl['workload']}")
        for r in wl["arms"]:
            theirs = f"{r['theirs_per_gpu']:.2f}" if "theirs_per_gpu" in r else "-"
            err = f"{r['rel_error'] * 100:+.1f}%" if "rel_error" in r else ""
            print(f"  {r['arm']:<30} GPUs {r['gpus']}  ours {r['ours_per_gpu']:.2f}  "
                  f"theirs {theirs} {err}  ({r['what']})")  # fmt: skip
    print(f"max_rel_error {res['max_rel_error']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
