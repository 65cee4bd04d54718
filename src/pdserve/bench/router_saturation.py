"""`pdserve bench router-saturation`: where one router process saturates, with emulated
workers (so that the workers are never the limit).

For each worker count: a colocated emulated cluster (`pdserve up --emulate`); then
- short requests: C closed-loop clients of 8-token prompts and 1 output token, C over
  `--concurrency`; completed requests/s;
- streamed tokens: C concurrent long streams (8-token prompts, `--stream-tokens` each), the
  tokens/s the clients receive over the window.
Every level records the router's and the client's CPU use (/proc/<pid>/stat: a router near
1.0 CPU-s/s is saturated), the router's CPU per unit of work (per request, per streamed token)
and the load average (the machine is shared). `--pin-router` gives the router a core of its
own (every thread of it on the machine's first CPU; the workers, the kvstore and the load
generator on the others), so its CPU per unit is not inflated by sharing a core and
1 / (CPU per unit) is the rate at which one router process saturates.

On 2 cores the workers and the load generator cannot drive a whole router core: they need more
CPU per token than the router does. `--router-cpu-quota F` caps the router at F of one core (a
CPU cgroup, root only) so that it saturates at a load this machine can generate: its throughput
plateaus while its CPU sits at F. The plateau / F estimates one full core; run two quotas to
check that the scaling is linear. `--profile-router` runs the router under cProfile for the
streaming levels and prints the top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pstats
import random
import time
from pathlib import Path
from typing import Any

from pdserve.bench.emulated_lag import _cpu_s


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("router-saturation", help="router req/s and tokens/s limits")
    p.add_argument("--workers", default="16,64")
    p.add_argument("--emulate", default="h100")
    p.add_argument("--model-config", default="llama3-8b")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--concurrency", default="16,64,256", help="client levels")
    p.add_argument("--duration", type=float, default=10.0, help="wall seconds per level")
    p.add_argument("--stream-tokens", type=int, default=4000)
    p.add_argument("--profile-router", action="store_true", help="cProfile the router")
    p.add_argument("--skip-short", action="store_true", help="streamed tokens only")
    p.add_argument(
        "--router-cpu-quota",
        type=float,
        default=0.0,
        help="cap the router at this fraction of one core (CPU cgroup; needs root)",
    )
    p.add_argument(
        "--pin-router",
        action="store_true",
        help="the router alone on the first CPU, everything else on the others",
    )
    p.add_argument("--out", default="results/router_saturation.json")
    p.set_defaults(func=main)


async def _short(addr: str, concurrency: int, duration: float) -> dict[str, float]:
    from pdserve.client import AsyncClient

    done = errors = 0
    stop = time.monotonic() + duration

    async def loop(k: int) -> None:
        nonlocal done, errors
        rng = random.Random(k)
        while time.monotonic() < stop:
            try:
                await client.generate(token_ids=[rng.randrange(100_000) for _ in range(8)],
                                      max_tokens=1, ignore_eos=True)  # fmt: skip
                done += 1
            except Exception:
                errors += 1

    async with AsyncClient(addr, timeout=120.0) as client:
        t0 = time.monotonic()
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        wall = time.monotonic() - t0
    return {"requests_per_s": done / wall, "errors": errors}


async def _streams(addr: str, concurrency: int, duration: float, n: int) -> dict[str, float]:
    from pdserve.client import AsyncClient

    tokens = messages = all_tokens = 0
    t_start = time.monotonic()
    window = [t_start + 0.3 * duration, t_start + duration]  # measure after the ramp

    async def one(k: int) -> None:
        nonlocal tokens, messages, all_tokens
        rng = random.Random(1000 + k)
        ids = [rng.randrange(100_000) for _ in range(8)]
        stream = client.generate_stream(token_ids=ids, max_tokens=n, ignore_eos=True)
        async for ev in stream:
            now = time.monotonic()
            all_tokens += len(ev.token_ids)
            if window[0] <= now < window[1]:
                tokens += len(ev.token_ids)
                messages += 1
            if now >= window[1]:
                break

    async with AsyncClient(addr, timeout=300.0) as client:
        tasks = [asyncio.ensure_future(one(k)) for k in range(concurrency)]
        await asyncio.sleep(duration + 0.1)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    span = window[1] - window[0]
    return {"tokens_per_s": tokens / span, "messages_per_s": messages / span,
            "tokens_per_message": tokens / max(messages, 1),
            "level_tokens_per_s": all_tokens / (time.monotonic() - t_start)}  # fmt: skip


def pin_process(pid: int, cpus: set[int]) -> None:
    """Every thread of `pid` (sched_setaffinity on a pid moves only its main thread)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def pin_router_alone(cluster: Any) -> dict[str, list[int]]:
    """The router on the machine's first CPU, every other process (and this one) on the
    others (all of the machine's, whatever affinity this process was started with)."""
    cpus = list(range(os.cpu_count() or 1))
    if len(cpus) < 2:
        raise SystemExit("--pin-router needs at least 2 CPUs")
    router_cpus, rest = {cpus[0]}, set(cpus[1:])
    for name, proc in cluster.processes.items():
        if proc.popen is not None:
            pin_process(proc.popen.pid, router_cpus if name == "router" else rest)
    pin_process(os.getpid(), rest)
    return {"router": sorted(router_cpus), "others": sorted(rest)}


CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
CGROUP_PERIOD_US = 100_000


def cap_cpu(pid: int, fraction: float, name: str) -> Path:
    """Move process `pid` (every thread) into a new CPU cgroup capped at `fraction` of one
    core; returns the cgroup's directory (remove it with `uncap`)."""
    quota = max(1000, int(fraction * CGROUP_PERIOD_US))
    v2 = (CGROUP_V2 / "cgroup.controllers").exists()
    if v2 and "cpu" not in (CGROUP_V2 / "cgroup.subtree_control").read_text().split():
        raise SystemExit("--router-cpu-quota: the cgroup v2 cpu controller is not enabled")
    group = (CGROUP_V2 if v2 else CGROUP_V1_CPU) / name
    try:
        group.mkdir(exist_ok=True)
        if v2:
            (group / "cpu.max").write_text(f"{quota} {CGROUP_PERIOD_US}")
        else:
            (group / "cpu.cfs_period_us").write_text(str(CGROUP_PERIOD_US))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        (group / "cgroup.procs").write_text(str(pid))
    except OSError as exc:
        raise SystemExit(f"--router-cpu-quota needs a writable CPU cgroup (root): {exc}") from exc
    return group


def uncap(group: Path) -> None:
    """Remove a cgroup made by `cap_cpu` (its processes have exited or are moved out)."""
    for _ in range(50):
        try:
            group.rmdir()
            return
        except OSError:
            time.sleep(0.1)  # the router is still exiting


def _level(cluster: Any, fn, *a) -> dict[str, Any]:
    router = cluster.processes["router"].popen.pid
    r0, c0, t0 = _cpu_s(router), time.process_time(), time.monotonic()
    out = asyncio.run(fn(cluster.addr, *a))
    wall = time.monotonic() - t0
    cpu = out["router_cpu_per_s"] = (_cpu_s(router) - r0) / wall
    out["client_cpu_per_s"] = (time.process_time() - c0) / wall
    out["loadavg_1m"] = os.getloadavg()[0]
    # router CPU per unit of work, both over the whole level
    if out.get("requests_per_s"):
        out["router_cpu_ms_per_request"] = 1e3 * cpu / out["requests_per_s"]
    if out.get("level_tokens_per_s"):
        out["router_cpu_us_per_token"] = 1e6 * cpu / out["level_tokens_per_s"]
    return out


def measure(
    n: int, args: argparse.Namespace, prof: Path | None, env: dict[str, str] | None = None
) -> dict[str, Any]:
    from pdserve.launcher import Cluster, ClusterConfig

    cfg = ClusterConfig(
        emulate=args.emulate, model_config=args.model_config, time_scale=args.time_scale,
        mode="colocated", colocated=n, port=0,
        worker_args=["--max-num-batched-tokens", "2048", "--max-num-seqs", "256"],
        router_python_args=["-m", "cProfile", "-o", str(prof)] if prof else [],
        env=dict(env or {}),
    )  # fmt: skip
    cluster = Cluster(cfg)
    cluster.start(timeout=600.0)
    own_cpus = os.sched_getaffinity(0)
    levels = [int(c) for c in args.concurrency.split(",")]
    row: dict[str, Any] = {"workers": n, "short": {}, "streams": {}}
    group = None
    try:
        if args.pin_router:
            row["pinned"] = pin_router_alone(cluster)
        if args.router_cpu_quota > 0:
            router_pid = cluster.processes["router"].popen.pid
            group = cap_cpu(router_pid, args.router_cpu_quota, f"pdserve-router-{router_pid}")
            row["router_cpu_quota"] = args.router_cpu_quota
        asyncio.run(_short(cluster.addr, 4, 1.0))  # warm-up
        if not prof and not args.skip_short:
            for c in levels:
                row["short"][c] = _level(cluster, _short, c, args.duration)
                print(f"   short  C={c:<4} {json.dumps(row['short'][c])}", flush=True)
        for c in levels:
            row["streams"][c] = _level(cluster, _streams, c, args.duration, args.stream_tokens)
            print(f"   stream C={c:<4} {json.dumps(row['streams'][c])}", flush=True)
    finally:
        cluster.stop()
        os.sched_setaffinity(0, own_cpus)  # this process was pinned with the cluster
        if group is not None:
            uncap(group)
    return row


def top_functions(path: Path, n: int = 25) -> list[dict[str, Any]]:
    st = pstats.Stats(str(path))
    total = st.total_tt  # type: ignore[attr-defined]
    rows = []
    for (file, line, func), (_cc, nc, tt, ct, _callers) in st.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({func})", "calls": nc,
                     "tottime_frac": tt / total, "cumtime_frac": ct / total})  # fmt: skip
    rows.sort(key=lambda r: -r["tottime_frac"])
    return rows[:n]


def main(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for n in [int(x) for x in args.workers.split(",") if x.strip()]:
        print(f"== {n} emulated workers, one router", flush=True)
        rows.append(measure(n, args, None))
    profile = None
    if args.profile_router:
        n = int(args.workers.split(",")[0])
        prof = out.with_suffix(".router.prof")
        print(f"== router under cProfile ({n} workers, streams)", flush=True)
        measure(n, args, prof)
        profile = top_functions(prof)
        for r in profile:
            print(f"   {r['tottime_frac']:6.1%} self {r['cumtime_frac']:6.1%} cum  "
                  f"{r['calls']:>9}  {r['function']}")  # fmt: skip
    out.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "func"},
                               "rows": rows, "router_profile": profile}, indent=1))  # fmt: skip
    print(f"wrote {out}")
    return 0
