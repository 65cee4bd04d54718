"""Stress (run by hand, not by pytest): kill a router replica mid-stream, wave after wave,
and report every stream whose tokens differ from the in-process engine's.

    PYTHONPATH=$PWD/src python -m tests.stress.router_kill --waves 40 [--victim random]

Two routers sharing a Redis, 1 prefill + 1 decode + kvstore, under the launcher's Supervisor
(what `pdserve up --routers 2` runs; test_router_replicas.py's cluster). Each wave: 16
streams of 400 tokens, greedy and seeded top-p alternately, new prompts per wave (`--seed`
fixes one set instead); once every stream has 5 tokens, a router is SIGKILLed (`--victim`:
the one relaying the most streams, a random one, or the flip leader); the SDK resumes its
streams on the other replica. Then every stream is compared with the in-process engine, the
router must be back and know both workers, and every KV pool must drain. Prints one line per
wave: the victim, client-visible failures, and each wrong stream with where it diverges.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import tempfile
import time
from pathlib import Path

from tests.integration.conftest import VOCAB, engine_tokens, pool_idle, start_cluster, wait_until
from tests.integration.replica_streams import (
    RouterKiller,
    busiest,
    divergence,
    flip_leaders,
    serves_every_worker,
    streams_until,
)

STREAMS, MAX_TOKENS = 16, 400
WORKER_ARGS = ["--num-blocks", "2048", "--max-num-batched-tokens", "512"]


def _status(addr: str):
    from pdserve.client import Client

    with Client(addr, max_retries=0) as client:
        return client.status(timeout=5)


def _leader(cluster) -> str | None:
    """The one router holding the flip leadership, if exactly one does."""
    leaders = flip_leaders(cluster)
    return leaders[0] if len(leaders) == 1 else None


def _chooser(how: str, cluster, rng: random.Random):
    if how == "busiest":
        return busiest
    if how == "random":
        return lambda running: rng.choice(sorted(running))
    return lambda _running: _leader(cluster)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--waves", type=int, default=20)
    p.add_argument("--victim", choices=["busiest", "random", "leader"], default="busiest")
    p.add_argument("--seed", type=int, default=None, help="one prompt set for every wave")
    args = p.parse_args()
    os.environ.setdefault("PDSERVE_DTYPE", "float32")

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.model.tiny import TinySpec, make_tiny
    from pdserve.supervisor import RestartPolicy, Supervisor, SupervisorThread
    from pdserve.workload.requests import greedy_and_seeded_streams

    model = make_tiny(Path(tempfile.mkdtemp()) / "llama", TinySpec(vocab=VOCAB, max_pos=1024))
    reference = LLMEngine(EngineConfig(model_dir=str(model), dtype="float32", num_blocks=2048))
    cluster = start_cluster(
        model, routers=2, prefill=1, decode=1, kvstore=True,
        worker_args=WORKER_ARGS, router_args=["--flip-enabled", "--flip-interval-s", "0.5"],
    )  # fmt: skip
    print(f"logs: {cluster.log_dir}", flush=True)
    rng = random.Random(0)
    bad = 0
    try:
        with SupervisorThread(Supervisor(cluster, RestartPolicy(0.2, 2.0), lambda _s: None)):
            for wave in range(args.waves):
                t0 = time.monotonic()
                seed = args.seed if args.seed is not None else 1000 + wave
                requests = greedy_and_seeded_streams(STREAMS, MAX_TOKENS, VOCAB, seed)
                for i, r in enumerate(requests):
                    r["request_id"] = f"w{wave}-s{i}"
                expected = engine_tokens(reference, requests)
                if args.victim == "leader":
                    wait_until(lambda: _leader(cluster) is not None, 60, "a flip leader")
                killer = RouterKiller(cluster, _status, choose=_chooser(args.victim, cluster, rng))
                results = asyncio.run(streams_until(cluster.addrs, requests, killer, key=""))
                errors = [
                    (f"w{wave}-s{i}", repr(r)[:200])
                    for i, r in enumerate(results)
                    if isinstance(r, BaseException)
                ]
                wrong = {
                    f"w{wave}-s{i}": divergence(r[0], e, killer.at_kill[i])
                    for i, (r, e) in enumerate(zip(results, expected, strict=True))
                    if not isinstance(r, BaseException) and r[0] != e
                }
                bad += bool(errors or wrong)
                print(
                    f"wave {wave}: killed {killer.victim}, {time.monotonic() - t0:.1f} s, "
                    f"errors {errors}, wrong {wrong}",
                    flush=True,
                )
                for addr in cluster.addrs:
                    wait_until(
                        lambda addr=addr: serves_every_worker(cluster, addr, _status),
                        120,
                        f"{addr} serves and knows every worker",
                    )
                for name in cluster.worker_names():
                    wait_until(lambda name=name: pool_idle(cluster, name), 30, f"{name} idle")
    finally:
        cluster.stop()
    print(f"{bad} of {args.waves} waves had a wrong or failed stream")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
