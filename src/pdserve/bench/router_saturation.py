"""`pdserve bench router-saturation`: where one router process saturates, with emulated
workers (so that the workers are never the limit).

For each worker count: a colocated emulated cluster (`pdserve up --emulate`); then
- short requests: C closed-loop clients of 8-token prompts and 1 output token, C over
  `--concurrency`; completed requests/s;
- streamed tokens: C concurrent long streams (8-token prompts, `--stream-tokens` each), the
  tokens/s the clients receive over the window.
Every level records the router's and the client's CPU use (/proc/<pid>/stat: a router near
1.0 CPU-s/s is saturated) and the load average (the machine is shared). `--profile-router`
runs the router under cProfile for the streaming levels and prints the top functions.
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
    p.add_argument(
        "--compare-relay",
        action="store_true",
        help="also run each worker count with the old relay (PDSERVE_RELAY_WAIT_FOR=1: an "
        "asyncio.wait_for per relayed message) and print new / old",
    )
    p.add_argument("--skip-short", action="store_true", help="streamed tokens only")
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

    tokens = messages = 0
    t_start = time.monotonic()
    window = [t_start + 0.3 * duration, t_start + duration]  # measure after the ramp

    async def one(k: int) -> None:
        nonlocal tokens, messages
        rng = random.Random(1000 + k)
        ids = [rng.randrange(100_000) for _ in range(8)]
        stream = client.generate_stream(token_ids=ids, max_tokens=n, ignore_eos=True)
        async for ev in stream:
            now = time.monotonic()
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
            "tokens_per_message": tokens / max(messages, 1)}  # fmt: skip


def _level(cluster: Any, fn, *a) -> dict[str, Any]:
    router = cluster.processes["router"].popen.pid
    r0, c0, t0 = _cpu_s(router), time.process_time(), time.monotonic()
    out = asyncio.run(fn(cluster.addr, *a))
    wall = time.monotonic() - t0
    out["router_cpu_per_s"] = (_cpu_s(router) - r0) / wall
    out["client_cpu_per_s"] = (time.process_time() - c0) / wall
    out["loadavg_1m"] = os.getloadavg()[0]
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
    levels = [int(c) for c in args.concurrency.split(",")]
    row: dict[str, Any] = {"workers": n, "short": {}, "streams": {}}
    try:
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
        if args.compare_relay:
            print(f"== {n} emulated workers, old relay (PDSERVE_RELAY_WAIT_FOR=1)", flush=True)
            old = measure(n, args, None, {"PDSERVE_RELAY_WAIT_FOR": "1"})
            old["relay"] = "wait_for"
            rows.append(old)
            new = rows[-2]
            for kind, key in (("short", "requests_per_s"), ("streams", "tokens_per_s")):
                for c in new[kind]:
                    a, b = new[kind][c][key], old[kind][c][key]
                    print(f"   {kind} C={c}: {key} new/old = {a / b if b else float('nan'):.2f}")
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
