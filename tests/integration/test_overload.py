"""Load held on both doors, in miniature: a 1P1D cluster whose decode holds 32 KV blocks and
runs 4 sequences at once gets 64 concurrent streams per door (the openai client over HTTP,
the SDK over gRPC), each asking for 32 tokens, with the router's wait for KV capped at 3 s.

Placed all at once (the router's behaviour before its admission followed the workers'
batch slots), most streams waited for KV after their reservation was refused, and about
half of them failed with 429 "need N KV blocks" when that wait ran out. Now the router runs
what the decode's batch slots allow (2 per slot) and the rest wait in its admission queue,
before any work is done. Every stream gets its 32 tokens; nothing is left held."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import pool_idle, start_cluster, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_cluster(serving_model_dir):
    cluster = start_cluster(
        serving_model_dir,
        prefill=1,
        decode=1,
        http_port=0,
        worker_args=["--num-blocks", "32", "--max-num-batched-tokens", "512",
                     "--max-num-seqs", "4"],
        router_args=["--kv-queue-timeout-s", "3"],
    )  # fmt: skip
    try:
        yield cluster
    finally:
        cluster.stop()


def test_more_streams_than_the_cluster_runs_wait_in_admission(small_cluster):
    from pdserve.bench.doorload import run_load
    from pdserve.client import Client

    cluster = small_cluster
    rows = asyncio.run(
        run_load(
            streams=64, door="both", addr=cluster.addr, http_url=cluster.http_url, max_tokens=32
        )
    )
    for row in rows:
        assert (row["ok"], row["failed"]) == (64, 0), row
    status = Client(cluster.addr).status()
    assert status.requests_total == 128 and status.requests_running == 0
    for name in ("decode0", "prefill0"):
        wait_until(lambda name=name: pool_idle(cluster, name), 30, f"{name} pool idle")
