"""The router's CPU for watching N open streams: one task per stream vs one `StreamWatch`.

    python -m pdserve.bench.stream_watch_cost --streams 64,256,1024 --seconds 5

Every relayed stream needs a watchdog (instance lost, read deadline). This measures what
that costs a router whose streams are open but between tokens: the process CPU time (user +
sys) over `--seconds` of wall time, on uvloop as the router runs, with N watched streams and
nothing else, for both designs in the same process (arms alternating, best of `--repeats`):
- "per-stream": a task per stream that sleeps DECODE_WATCH_S and checks the stream (the
  relay's watchdog until 2026-12-02);
- "shared": `StreamWatch`, one task for all streams.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from pdserve.router.cluster.registry import ROLE_DECODE, Registry
from pdserve.router.lifecycle.orchestrator import DECODE_WATCH_S
from pdserve.router.lifecycle.stream_watch import StreamWatch, WatchedStream


class _Call:
    def cancel(self) -> None:  # never reached: the streams stay healthy
        raise AssertionError("a healthy stream was cut")


async def _per_stream(registry: Registry, stream: WatchedStream) -> None:
    while True:
        await asyncio.sleep(DECODE_WATCH_S)
        if registry.lost(stream.instance_id) or time.monotonic() > stream.deadline:
            stream.call.cancel()
            return


async def _measure(design: str, n: int, seconds: float, instances: int) -> float:
    """Process CPU seconds per wall second with `n` healthy streams watched by `design`."""
    registry = Registry(heartbeat_timeout_s=3600.0)
    ids = [f"d{i}" for i in range(instances)]
    for i, iid in enumerate(ids):
        registry.register(iid, f"127.0.0.1:{2000 + i}", ROLE_DECODE, "fp", 16)
    watch = StreamWatch(registry, lambda: DECODE_WATCH_S)
    tasks: list[asyncio.Task] = []
    streams = []
    for k in range(n):
        if design == "shared":
            streams.append(watch.watch(_Call(), ids[k % instances], 3600.0))
        else:
            s = WatchedStream(_Call(), ids[k % instances], 3600.0)
            tasks.append(asyncio.ensure_future(_per_stream(registry, s)))
    await asyncio.sleep(DECODE_WATCH_S)  # past the start-up
    cpu0, wall0 = time.process_time(), time.perf_counter()
    await asyncio.sleep(seconds)
    cpu = time.process_time() - cpu0
    wall = time.perf_counter() - wall0
    for t in tasks:
        t.cancel()
    for s in streams:
        watch.unwatch(s)
    await asyncio.gather(*tasks, return_exceptions=True)
    return cpu / wall


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--streams", default="64,256,1024")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--instances", type=int, default=16)
    args = p.parse_args(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    rows = []
    for n in (int(x) for x in args.streams.split(",")):
        best = {"per-stream": float("inf"), "shared": float("inf")}
        for _ in range(args.repeats):
            for design in best:
                cores = asyncio.run(_measure(design, n, args.seconds, args.instances))
                best[design] = min(best[design], cores)
        row = {"streams": n, **{f"{k}_cores": round(v, 5) for k, v in best.items()}}
        rows.append(row)
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
