"""Stress (run by hand, not by pytest): freeze a decode with SIGSTOP at a random moment of a
wave of concurrent streams and report any stream that hangs instead of migrating.

    PYTHONPATH=$PWD/src python -m tests.stress.frozen_decode --waves 16 [--signal kill]

2 prefill + 2 decode worker processes under the launcher's Supervisor (what `pdserve up`
runs). Each wave: 12 concurrent 200-token greedy streams; after a random 0-1.2 s a random
decode is frozen (or killed); streams get 60 s to finish; then the victim is SIGKILLed and
restarted, and every worker's KV pool must drain. Prints one line per wave: its duration,
the streams that hung (with the tokens each had) and client-visible errors.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import tempfile
import time
from pathlib import Path

from tests.integration.conftest import pool_idle, wait_until, worker_info

STREAMS, MAX_TOKENS, HANG_S = 12, 200, 60.0


async def _wave(cluster, wave: int, sig: int) -> tuple[str, list[str], list, dict[str, int]]:
    from pdserve.client import AsyncClient

    rng = random.Random(wave)
    requests = [
        dict(
            token_ids=[rng.randint(2, 511) for _ in range(rng.randint(8, 48))],
            max_tokens=MAX_TOKENS,
            ignore_eos=True,
            temperature=0.0,
            request_id=f"w{wave}-s{i}",
        )
        for i in range(STREAMS)
    ]
    got = {r["request_id"]: 0 for r in requests}

    async def one(client, req):
        async for ev in client.generate_stream(**req):
            got[req["request_id"]] += len(ev.token_ids)

    async with AsyncClient(cluster.addr, timeout=HANG_S + 30, max_retries=0) as client:
        tasks = [asyncio.ensure_future(one(client, r)) for r in requests]
        await asyncio.sleep(rng.uniform(0.0, 1.2))
        victim = rng.choice(["decode0", "decode1"])
        proc = cluster.processes[victim]
        proc.signal(sig)
        await asyncio.wait(tasks, timeout=HANG_S)
        hung = [r["request_id"] for r, t in zip(requests, tasks, strict=True) if not t.done()]
        errors = [
            (r["request_id"], repr(t.exception())[:200])
            for r, t in zip(requests, tasks, strict=True)
            if t.done() and not t.cancelled() and t.exception()
        ]
        proc.signal(signal.SIGKILL)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return victim, hung, errors, got


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waves", type=int, default=12)
    p.add_argument("--signal", choices=["stop", "kill"], default="stop")
    args = p.parse_args()
    os.environ.setdefault("PDSERVE_DTYPE", "float32")

    from pdserve.launcher import Cluster, ClusterConfig
    from pdserve.model.tiny import TinySpec, make_tiny
    from pdserve.supervisor import RestartPolicy, Supervisor, SupervisorThread

    model = make_tiny(Path(tempfile.mkdtemp()) / "llama", TinySpec(vocab=512, max_pos=256))
    cluster = Cluster(
        ClusterConfig(
            model=str(model),
            port=0,
            prefill=2,
            decode=2,
            worker_args=["--num-blocks", "256", "--max-num-batched-tokens", "512"],
        )
    )
    cluster.start(timeout=180)
    print(f"logs: {cluster.log_dir}", flush=True)
    sig = signal.SIGSTOP if args.signal == "stop" else signal.SIGKILL
    bad = 0
    try:
        with SupervisorThread(Supervisor(cluster, RestartPolicy(0.2, 2.0), lambda _s: None)):
            for wave in range(args.waves):
                t0 = time.monotonic()
                victim, hung, errors, got = asyncio.run(_wave(cluster, wave, sig))
                bad += bool(hung or errors)
                print(
                    f"wave {wave}: {args.signal} {victim}, {time.monotonic() - t0:.1f} s, "
                    f"hung {[(h, got[h]) for h in hung]}, errors {errors}",
                    flush=True,
                )

                def back(victim=victim) -> bool:
                    proc = cluster.processes[victim]
                    if not proc.alive or proc.port is None:
                        return False
                    try:
                        worker_info(cluster, victim)
                    except Exception:
                        return False
                    return True

                wait_until(back, 120, f"{victim} back")
                for name in cluster.worker_names():
                    wait_until(lambda name=name: pool_idle(cluster, name), 30, f"{name} idle")
    finally:
        cluster.stop()
    print(f"{bad} of {args.waves} waves had a hung or failed stream")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
