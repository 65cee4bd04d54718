"""Router kills under load: do streams outlive their router?

A cluster as `pdserve up --routers 2 --prefill 2 --decode 2` runs it (real processes, a real
Redis, the supervisor restarting what dies), on the built-in tiny model in the default
dtype. First one wave of `--streams` SDK streams without kills gives the expected tokens
and text; then waves of the same streams run back to back for `--duration-s` seconds while
a router is killed with SIGKILL every `--kill-every-s` seconds (the one carrying the most
streams). Every stream is compared with the run without kills. `--idle-wait-s` after the
last wave every worker's KV pool is read.

Prints (and with --json writes) three counts, the acceptance criteria of a router-kill run:
  failed        streams that ended with an error
  wrong         streams whose tokens or text differ from the run without kills
  blocks_held   KV blocks still held on the workers `--idle-wait-s` after the load

    .venv/bin/python -m benchmarks.router_kill                      # 2 routers, 2P2D, 3 min
    .venv/bin/python -m benchmarks.router_kill --duration-s 40 --kill-every-s 15   # short
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import sys
import time

from pdserve.client import AsyncClient
from pdserve.workload.requests import greedy_and_seeded_streams


async def wave(client: AsyncClient, reqs: list[dict]) -> list:
    """(tokens, text) per stream, or the exception it ended with."""

    async def one(req: dict):
        tokens, text = [], []
        async for ev in client.generate_stream(**req):
            tokens += ev.token_ids
            text.append(ev.text)
        return tokens, "".join(text)

    return await asyncio.gather(*(one(r) for r in reqs), return_exceptions=True)


async def running(addr: str) -> int:
    """Streams a router runs now by its Status (-1: it does not answer)."""
    try:
        async with AsyncClient(addr, max_retries=0) as c:
            return (await c.status(timeout=2)).requests_running
    except Exception:
        return -1


async def killer(cluster, every_s: float, kills: list) -> None:
    """SIGKILL a router every `every_s` seconds (until cancelled): the one running the most
    streams by its Status, taking turns on a tie; never while another one is still down."""
    t0 = time.monotonic()
    while True:
        await asyncio.sleep(every_s)
        # One router at a time: the last victim must be back (serving) first. On a slow,
        # busy machine a restart can take longer than the interval; the kill then waits and
        # the printed times say so.
        names = cluster.router_names()
        load = {n: await running(f"127.0.0.1:{cluster.router_ports[n][0]}") for n in names}
        while min(load.values()) < 0:
            await asyncio.sleep(0.5)
            load = {n: await running(f"127.0.0.1:{cluster.router_ports[n][0]}") for n in names}
        turn = len(kills) % len(names)
        victim = max(names, key=lambda n: (load[n], names.index(n) == turn))
        cluster.processes[victim].signal(signal.SIGKILL)
        kills.append((round(time.monotonic() - t0, 1), victim, load[victim]))
        print(f"  t={kills[-1][0]:6.1f}s  SIGKILL {victim} ({load[victim]} streams)", flush=True)


async def run_load(cluster, reqs: list[dict], duration_s: float, every_s: float) -> dict:
    """The run without kills, then waves with kills; the counts."""
    out: dict = {"failed": 0, "wrong": 0, "streams": 0, "waves": 0, "kills": [], "errors": []}
    async with AsyncClient(cluster.addrs, timeout=300.0) as client:
        ref = await wave(client, reqs)
        bad = [r for r in ref if isinstance(r, BaseException)]
        if bad:
            raise SystemExit(f"the run without kills failed: {bad[0]!r}")
        print(f"reference wave: {len(ref)} streams, no kill", flush=True)
        task = asyncio.ensure_future(killer(cluster, every_s, out["kills"]))
        deadline = time.monotonic() + duration_s
        due = int(duration_s // every_s)  # kills at every_s, 2 every_s, ... up to duration_s
        try:
            while time.monotonic() < deadline or len(out["kills"]) < due:
                results = await wave(client, reqs)
                out["waves"] += 1
                for got, exp in zip(results, ref, strict=True):
                    out["streams"] += 1
                    if isinstance(got, BaseException):
                        out["failed"] += 1
                        out["errors"].append(repr(got)[:300])
                    elif got != exp:
                        out["wrong"] += 1
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return out


async def vocab_size(addrs: list[str]) -> int:
    async with AsyncClient(addrs) as c:
        return (await c.status()).vocab_size


def blocks_held(cluster) -> dict[str, dict[str, float]]:
    """Per worker: KV blocks not free, reservations, blocks held for publishing."""
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    out = {}
    for name in cluster.worker_names():
        with cluster.internal_channel(name, as_name="admin") as ch:
            c = worker_pb2_grpc.WorkerStub(ch).Info(worker_pb2.InfoRequest(), timeout=10).counters
        out[name] = {
            "not_free": c["pool_total_blocks"] - c["pool_free_blocks"],
            "reservations": c["pool_reservations"],
            "held": c["pool_held_blocks"],
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--routers", type=int, default=2)
    p.add_argument("--prefill", type=int, default=2)
    p.add_argument("--decode", type=int, default=2)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--duration-s", type=float, default=180.0)
    p.add_argument("--kill-every-s", type=float, default=30.0)
    p.add_argument("--idle-wait-s", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", default=None)
    p.add_argument("--json", default=None, help="also write the result here")
    args = p.parse_args(argv)

    from pdserve.launcher import Cluster, ClusterConfig
    from pdserve.supervisor import RestartPolicy, Supervisor, SupervisorThread

    config = ClusterConfig(
        routers=args.routers, prefill=args.prefill, decode=args.decode, kvstore=True,
        port=0, http_port=0, log_dir=args.log_dir,
        worker_args=["--num-blocks", "4096", "--max-num-batched-tokens", "1024"],
    )  # fmt: skip
    cluster = Cluster(config)
    t_start = time.monotonic()
    cluster.start(timeout=600)
    print(f"cluster up in {time.monotonic() - t_start:.0f} s: routers {cluster.addrs}; "
          f"logs {cluster.log_dir}", flush=True)  # fmt: skip
    supervisor = Supervisor(cluster, RestartPolicy(initial_s=0.2, max_s=2.0))
    try:
        with SupervisorThread(supervisor):
            vocab = asyncio.run(vocab_size(cluster.addrs))
            reqs = greedy_and_seeded_streams(args.streams, args.max_tokens, vocab, args.seed)
            out = asyncio.run(run_load(cluster, reqs, args.duration_s, args.kill_every_s))
            time.sleep(args.idle_wait_s)
            pools = blocks_held(cluster)
    finally:
        cluster.stop()
    held = int(sum(w["not_free"] + w["held"] for w in pools.values()))
    cmd = shlex.join(sys.argv[1:] if argv is None else argv)
    result = {
        "command": f"python -m benchmarks.router_kill {cmd}".strip(),
        "failed": out["failed"],
        "wrong": out["wrong"],
        "blocks_held": held,
        "reservations_left": int(sum(w["reservations"] for w in pools.values())),
        "streams": out["streams"],
        "waves": out["waves"],
        "kills": out["kills"],
        "restarts": supervisor.restarts,
        "tokens_per_stream": args.max_tokens,
        "errors": out["errors"][:5],
    }
    print(f"failed={out['failed']} wrong={out['wrong']} blocks_held={held}  ({out['streams']} "
          f"streams in {out['waves']} waves, {len(out['kills'])} router kills)")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if out["failed"] == out["wrong"] == held == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
