"""`pdserve bench emulated-lag`: how faithfully emulated workers keep modelled time as their
number grows on this machine (`pdserve up --emulate`, colocated, one router).

For each worker count N: start the cluster, drive `--streams-per-worker` closed-loop streams per
worker through the router for `--duration` wall seconds, and read every worker's counters
before and after: the step lag = sum(wall end - modelled deadline) / sum(modelled step time)
over every step of the window (the emulated runner's own accounting, pdserve.emulate.runner),
the steps, the tokens streamed, the CPU seconds used by the workers and the router
(/proc/<pid>/stat) and their memory (VmRSS), and the load average (the machine is shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import time
from pathlib import Path
from typing import Any

TICKS = os.sysconf("SC_CLK_TCK")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("emulated-lag", help="step lag of N emulated workers + a router")
    p.add_argument("--workers", default="8,16,32,64", help="comma-separated worker counts")
    p.add_argument("--emulate", default="h100")
    p.add_argument("--model-config", default="llama3-8b")
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--duration", type=float, default=30.0, help="measured wall seconds per N")
    p.add_argument("--streams-per-worker", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=10.0,
        help="router's heartbeat timeout (a shared 2-core machine under load delays "
        "heartbeats: at the default 3 s, 64 workers were expired mid-stream)",
    )
    p.add_argument("--out", default="results/emulated_lag.json")
    p.set_defaults(func=main)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime + stime


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _counters(cluster: Any) -> dict[str, dict[str, float]]:
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    out = {}
    for name in cluster.worker_names():
        with cluster.internal_channel(name, as_name="admin") as ch:
            info = worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=10)
        out[name] = dict(info.counters)
    return out


async def _drive(addr: str, streams: int, duration: float, prompt_len: int, max_tokens: int):
    from pdserve.client import AsyncClient

    tokens = 0
    requests = 0
    errors = 0
    stop = time.monotonic() + duration

    async def loop(k: int) -> None:
        nonlocal tokens, requests, errors
        rng = random.Random(k)
        while time.monotonic() < stop:
            ids = [rng.randrange(100_000) for _ in range(prompt_len)]
            try:
                r = await client.generate(token_ids=ids, max_tokens=max_tokens, ignore_eos=True)
                tokens += len(r.token_ids)
                requests += 1
            except Exception:
                errors += 1

    async with AsyncClient(addr, timeout=300.0) as client:
        await asyncio.gather(*(loop(k) for k in range(streams)))
    return {"tokens": tokens, "requests": requests, "errors": errors}


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.launcher import Cluster, ClusterConfig

    cfg = ClusterConfig(
        emulate=args.emulate, model_config=args.model_config, time_scale=args.time_scale,
        mode="colocated", colocated=n, port=0,
        worker_args=["--max-num-batched-tokens", "2048", "--max-num-seqs", "128"],
        router_args=["--heartbeat-timeout-s", str(args.heartbeat_timeout_s)],
    )  # fmt: skip
    cluster = Cluster(cfg)
    t_start = time.monotonic()
    cluster.start(timeout=600.0)
    started_s = time.monotonic() - t_start
    try:
        pids = {name: p.popen.pid for name, p in cluster.processes.items() if p.popen}
        streams = n * args.streams_per_worker
        asyncio.run(_drive(cluster.addr, streams, 3.0 * args.time_scale / 10, 64, 8))  # warm
        before, cpu0 = _counters(cluster), {k: _cpu_s(p) for k, p in pids.items()}
        t0 = time.monotonic()
        load = asyncio.run(
            _drive(cluster.addr, streams, args.duration, args.prompt_len, args.max_tokens)
        )
        wall = time.monotonic() - t0
        after, cpu1 = _counters(cluster), {k: _cpu_s(p) for k, p in pids.items()}
        loadavg = os.getloadavg()
        rss = {k: _rss_mb(p) for k, p in pids.items()}
    finally:
        cluster.stop()

    def delta(key: str) -> float:
        return sum(after[w].get(key, 0.0) - before[w].get(key, 0.0) for w in after)

    modelled, lag = delta("emulate_modelled_s"), delta("emulate_lag_s")
    workers = [w for w in pids if w.startswith("colocated")]
    busy = modelled * args.time_scale / (wall * n)  # fraction of wall each worker stepped
    return {
        "workers": n,
        "time_scale": args.time_scale,
        "started_s": started_s,
        "wall_s": wall,
        "steps": delta("emulate_steps"),
        "modelled_s": modelled,
        "lag": lag / modelled if modelled else None,
        # modelled time busy engines lost between steps (late starts), per modelled second
        "gap": delta("emulate_gap_s") / modelled if modelled else None,
        "max_step_lag_ms": max(a.get("emulate_max_lag_s", 0.0) for a in after.values()) * 1e3,
        "busy_fraction": busy,
        "streamed_tokens": load["tokens"],
        "requests": load["requests"],
        "errors": load["errors"],
        "modelled_tokens_per_s": load["tokens"] / (wall / args.time_scale),
        "cpu_s_workers": sum(cpu1[w] - cpu0[w] for w in workers),
        "cpu_s_router": cpu1["router"] - cpu0["router"],
        "rss_mb_worker_mean": sum(rss[w] for w in workers) / len(workers),
        "rss_mb_router": rss["router"],
        "loadavg_1m_5m_15m": loadavg,
    }


def main(args: argparse.Namespace) -> int:
    rows = []
    for n in [int(x) for x in args.workers.split(",") if x.strip()]:
        print(f"== {n} emulated workers ({args.emulate}, {args.model_config}, "
              f"time scale {args.time_scale})", flush=True)  # fmt: skip
        row = measure(n, args)
        rows.append(row)
        lag = row["lag"]
        print(f"   lag {lag:.2%}" if lag is not None else "   lag -", flush=True)
        print("   " + json.dumps({k: v for k, v in row.items() if k != "workers"}), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "func"},
                               "rows": rows}, indent=1))  # fmt: skip
    print(f"{'workers':>8} {'lag':>8} {'busy':>6} {'cpu/wall w':>11} {'cpu/wall r':>11} "
          f"{'RSS MB/w':>9} {'load 1m':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['workers']:>8} {r['lag'] or 0:>8.2%} {r['busy_fraction']:>6.2f} "
              f"{r['cpu_s_workers'] / r['wall_s']:>11.2f} {r['cpu_s_router'] / r['wall_s']:>11.2f} "
              f"{r['rss_mb_worker_mean']:>9.0f} {r['loadavg_1m_5m_15m'][0]:>8.2f}")  # fmt: skip
    print(f"wrote {out}")
    return 0
