"""`pdserve bench router-saturation`: the router's CPU per short request and per streamed token,
with emulated workers (so that the workers are never the limit), optionally against a
baseline source tree in the same run.

One colocated emulated cluster (`pdserve up --emulate`) per arm: the current code, and with
`--baseline-src DIR` a baseline whose processes all run from DIR/src (PYTHONPATH; make DIR
with `git archive <commit> src | tar -x -C DIR`), so the old code lives nowhere in the
package. Both clusters stay up; the levels run arm after arm (which arm goes first alternates
each repeat), `--repeats` times:
- short requests: C closed-loop clients of 8-token prompts and 1 output token;
- streams: C concurrent long streams (8-token prompts, `--stream-tokens` each).
Each level is measured over a window after its ramp (bench/saturation_load.py); the routers'
CPU is read at the window's ends, so while one arm runs, the other arm's router is measured
idle over the same window. Each arm's idle CPU rate (heartbeats, housekeeping), pooled over
every window in which it was idle, is subtracted: `router_cpu_us_per_token` and
`router_cpu_ms_per_request` are the CPU the work itself costs. With one arm, an idle window
of the same length precedes each level. Means with 95 % confidence intervals over the
repeats, and the per-repeat ratio of the arms.

On 2 cores the workers and the load generator cannot drive a whole router core;
`--router-cpu-quota F` caps each router at F of one core (a CPU cgroup, root only) so that it
saturates at a load this machine can generate. `--pin-router` puts the routers on the first
CPU and everything else on the others. `--profile-router` runs the current arm's router under
cProfile for one streaming level afterwards and prints the top functions.

`--replicas N` compares instead one router with N router replicas of the current code
(`pdserve up --routers N`, each router capped by `--router-cpu-quota`; the clients spread
over every replica with the SDK's address list): per level, the ratio of the arms'
`tokens_per_s` (or `requests_per_s`) with its 95 % CI, `rate_ratio`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench import saturation_load as load
from pdserve.bench.isolation import cap_cpu, pin_process, uncap
from pdserve.bench.stats_ci import ci95, fmt_ci


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("router-saturation", help="router CPU per request and per token")
    p.add_argument("--workers", type=int, default=16, help="emulated colocated workers per arm")
    p.add_argument("--emulate", default="h100")
    p.add_argument("--model-config", default="llama3-8b")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--concurrency", default="64,256", help="client levels")
    p.add_argument("--duration", type=float, default=6.0, help="wall seconds per level")
    p.add_argument("--repeats", type=int, default=3, help="rounds over every level and arm")
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--skip-short", action="store_true", help="streamed tokens only")
    p.add_argument("--skip-streams", action="store_true", help="short requests only")
    p.add_argument("--baseline-src", help="DIR holding src/pdserve of the baseline arm")
    p.add_argument("--replicas", type=int, default=0, help="1 router vs N replicas instead")
    p.add_argument("--profile-router", action="store_true", help="cProfile the router")
    p.add_argument("--profile-load", choices=["streams", "short"], default="streams")
    p.add_argument(
        "--router-cpu-quota", type=float, default=0.0,
        help="cap each router at this fraction of one core (CPU cgroup; needs root)",
    )  # fmt: skip
    p.add_argument(
        "--pin-router", action="store_true",
        help="the routers on the first CPU, everything else on the others",
    )  # fmt: skip
    p.add_argument("--out", default="results/router_saturation.json")
    p.set_defaults(func=main)


@dataclass
class Arm:
    name: str
    src: Path | None  # None: the installed package (the current code)
    routers: int = 1
    cluster: Any = None
    router_pids: list[int] = field(default_factory=list)
    groups: list[Path] = field(default_factory=list)
    samples: dict[tuple[str, int], list[dict[str, float]]] = field(default_factory=dict)
    idle_cpu_s: float = 0.0
    idle_s: float = 0.0

    @property
    def idle_rate(self) -> float:
        """The router's CPU (cores) while idle, pooled over its idle windows."""
        return self.idle_cpu_s / self.idle_s if self.idle_s else 0.0

    @property
    def addr(self) -> str:
        """Every router's address (the SDK spreads its calls over them)."""
        return ",".join(self.cluster.addrs)

    def router_cpu_s(self) -> float:
        return sum(load.process_cpu_s(pid) for pid in self.router_pids)


def start_arm(arm: Arm, args: argparse.Namespace, prof: Path | None = None) -> None:
    from pdserve.launcher import Cluster, ClusterConfig

    env = {"PYTHONPATH": str(arm.src / "src")} if arm.src else {}
    cfg = ClusterConfig(
        emulate=args.emulate, model_config=args.model_config, time_scale=args.time_scale,
        mode="colocated", colocated=args.workers, port=0, routers=arm.routers,
        worker_args=["--max-num-batched-tokens", "2048", "--max-num-seqs", "256"],
        router_python_args=["-m", "cProfile", "-o", str(prof)] if prof else [], env=env,
    )  # fmt: skip
    arm.cluster = Cluster(cfg)
    arm.cluster.start(timeout=600.0)
    procs = arm.cluster.processes
    arm.router_pids = [procs[n].popen.pid for n in arm.cluster.router_names()]
    if args.router_cpu_quota > 0:
        for pid in arm.router_pids:
            arm.groups.append(cap_cpu(pid, args.router_cpu_quota, f"pdserve-router-{pid}"))
    asyncio.run(load.short_requests(arm.addr, 4, 1.0, {}))  # warm-up


def stop_arm(arm: Arm) -> None:
    if arm.cluster is not None:
        arm.cluster.stop()
    for group in arm.groups:
        uncap(group)


def pin_routers(arms: list[Arm]) -> dict[str, list[int]]:
    """The routers on the machine's first CPU, every other process (this one too) on the
    others."""
    cpus = list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        raise SystemExit("--pin-router needs at least 2 CPUs")
    first, rest = {cpus[0]}, set(cpus[1:])
    for arm in arms:
        routers = set(arm.cluster.router_names())
        for name, proc in arm.cluster.processes.items():
            if proc.popen is not None:
                pin_process(proc.popen.pid, first if name in routers else rest)
    pin_process(os.getpid(), rest)
    return {"routers": sorted(first), "others": sorted(rest)}


def run_level(arm: Arm, arms: list[Arm], kind: str, c: int, args: argparse.Namespace) -> None:
    """One level on `arm`; the other arms' routers are measured idle over the same window."""
    cpu = {a.name: a.router_cpu_s for a in arms}
    if len(arms) == 1:  # nobody else idles meanwhile: an idle window of its own first
        res = asyncio.run(load.idle(args.duration, cpu))
        arm.idle_cpu_s += res["cpu_s"][arm.name]
        arm.idle_s += res["window_s"]
    if kind == "short":
        res = asyncio.run(load.short_requests(arm.addr, c, args.duration, cpu))
    else:
        res = asyncio.run(load.streams(arm.addr, c, args.duration, args.stream_tokens, cpu))
    for other in arms:
        if other is not arm:
            other.idle_cpu_s += res["cpu_s"][other.name]
            other.idle_s += res["window_s"]
    sample = {k: v for k, v in res.items() if k != "cpu_s"}
    sample["router_cpu_s"] = res["cpu_s"][arm.name]
    sample["loadavg_1m"] = os.getloadavg()[0]
    arm.samples.setdefault((kind, c), []).append(sample)
    print(f"   {arm.name:<9} {kind:<7} C={c:<5} {json.dumps(sample)}", flush=True)
    time.sleep(2.0)  # let the cancelled streams settle before the next level


def _per_sample(arm: Arm, kind: str, s: dict[str, float]) -> dict[str, float] | None:
    """A sample's per-unit costs, net of the arm's idle router (None: it got no unit done,
    e.g. a load generator starved of CPU; such samples are left out and counted)."""
    if not s["requests" if kind == "short" else "tokens"]:
        return None
    net = s["router_cpu_s"] - arm.idle_rate * s["window_s"]
    out = {"router_cpu": s["router_cpu_s"] / s["window_s"]}
    if kind == "short":
        out["requests_per_s"] = s["requests"] / s["window_s"]
        out["router_cpu_ms_per_request"] = 1e3 * net / max(s["requests"], 1)
    else:
        out["tokens_per_s"] = s["tokens"] / s["window_s"]
        out["tokens_per_message"] = s["tokens"] / max(s["messages"], 1)
        out["router_cpu_us_per_token"] = 1e6 * net / max(s["tokens"], 1)
    return out


def summarize(arms: list[Arm], levels: list[tuple[str, int]]) -> list[dict[str, Any]]:
    rows = []
    for kind, c in levels:
        metric = "router_cpu_ms_per_request" if kind == "short" else "router_cpu_us_per_token"
        row: dict[str, Any] = {"kind": kind, "concurrency": c, "metric": metric}
        per_arm = {a.name: [_per_sample(a, kind, s) for s in a.samples[(kind, c)]] for a in arms}
        for name, samples in per_arm.items():
            valid = [s for s in samples if s is not None]
            row[name] = {k: ci95([s[k] for s in valid]) for k in valid[0]} if valid else {}
            row[name]["samples_left_out"] = len(samples) - len(valid)
        if len(arms) == 2:
            base, new = (per_arm[a.name] for a in arms)
            rate = "requests_per_s" if kind == "short" else "tokens_per_s"
            for field_, key in (
                (metric, f"{arms[1].name}_over_{arms[0].name}"),
                (rate, "rate_ratio"),
            ):
                ratios = [
                    n[field_] / b[field_]
                    for b, n in zip(base, new, strict=True)
                    if b is not None and n is not None and b[field_]
                ]
                row[key] = ci95(ratios) if ratios else None
        rows.append(row)
    return rows


def print_table(rows: list[dict[str, Any]], arms: list[Arm]) -> None:
    print(f"{'kind':<8}{'C':>6}  {'arm':<10}{'router CPU per unit, net (95% CI)':<36}"
          f"{'units/s':>10}{'router cores':>14}")  # fmt: skip
    for r in rows:
        rate = "requests_per_s" if r["kind"] == "short" else "tokens_per_s"
        unit = "ms/request" if r["kind"] == "short" else "us/token"
        for a in arms:
            st = r[a.name]
            if r["metric"] not in st:
                print(f"{r['kind']:<8}{r['concurrency']:>6}  {a.name:<10}no valid sample")
                continue
            print(f"{r['kind']:<8}{r['concurrency']:>6}  {a.name:<10}"
                  f"{fmt_ci(st[r['metric']], 3 if r['kind'] == 'short' else 1) + ' ' + unit:<36}"
                  f"{st[rate]['mean']:>10.0f}{st['router_cpu']['mean']:>14.3f}")  # fmt: skip
        for key in (f"{arms[-1].name}_over_{arms[0].name}", "rate_ratio"):
            if key in r:
                print(f"{'':<16}{key}: {fmt_ci(r[key], 3)}")
    for a in arms:
        print(f"idle router ({a.name}): {a.idle_rate:.4f} cores")


def top_functions(path: Path, n: int = 25) -> list[dict[str, Any]]:
    st = pstats.Stats(str(path))
    total = st.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": nc,
                     "tottime_frac": tt / total, "cumtime_frac": ct / total})  # fmt: skip
    rows.sort(key=lambda r: -r["tottime_frac"])
    return rows[:n]


def profile(args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """The current code's router under cProfile, one level (`--profile-load`)."""
    prof = out.with_suffix(".router.prof")
    arm = Arm("profiled", None)
    c = int(args.concurrency.split(",")[0])
    print(f"== router under cProfile ({args.workers} workers, {args.profile_load} C={c})")
    start_arm(arm, args, prof)
    try:
        run_level(arm, [arm], args.profile_load, c, args)
    finally:
        stop_arm(arm)
    rows = top_functions(prof)
    for r in rows:
        print(f"   {r['tottime_frac']:6.1%} self {r['cumtime_frac']:6.1%} cum  "
              f"{r['calls']:>9}  {r['function']}")  # fmt: skip
    return rows


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    arms = [Arm("current", None)]
    if args.replicas:
        if args.baseline_src:
            raise SystemExit("--replicas compares replicas of the current code: no --baseline-src")
        arms = [Arm("1router", None), Arm(f"{args.replicas}routers", None, args.replicas)]
    elif args.baseline_src:
        src = Path(args.baseline_src).resolve()
        if not (src / "src" / "pdserve" / "__init__.py").is_file():
            raise SystemExit(f"--baseline-src: no src/pdserve in {src} (git archive ... src)")
        arms.insert(0, Arm("baseline", src))
    concurrency = [int(c) for c in args.concurrency.split(",")]
    levels = [] if args.skip_short else [("short", c) for c in concurrency]
    levels += [] if args.skip_streams else [("streams", c) for c in concurrency]
    own_cpus = os.sched_getaffinity(0)
    pinned = None
    try:
        for arm in arms:
            print(f"== {arm.name}: {args.workers} emulated workers, {arm.routers} router(s)"
                  f"{f' (from {arm.src})' if arm.src else ''}", flush=True)  # fmt: skip
            start_arm(arm, args)
        if args.pin_router:
            pinned = pin_routers(arms)
        for rep in range(args.repeats):
            order = arms if rep % 2 == 0 else arms[::-1]
            for kind, c in levels:
                for arm in order:
                    run_level(arm, arms, kind, c, args)
    finally:
        for arm in arms:
            stop_arm(arm)
        os.sched_setaffinity(0, own_cpus)
    rows = summarize(arms, levels)
    print_table(rows, arms)
    prof = profile(args, out) if args.profile_router else None
    doc = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "arms": {a.name: {"src": str(a.src) if a.src else None, "idle_router_cpu": a.idle_rate}
                 for a in arms},
        "pinned": pinned,
        "levels": rows,
        "samples": {a.name: {f"{k}/{c}": v for (k, c), v in a.samples.items()} for a in arms},
        "router_profile": prof,
    }  # fmt: skip
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}")
    return 0
