"""Overload queues instead of failing: with a decode KV pool too small for the requests in
flight, Reserve is refused (RESOURCE_EXHAUSTED) and the router waits for blocks to free, so
every request completes with the reference tokens and no block leaks."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.client import AsyncClient

from .conftest import counter, pool_idle, reference_tokens, start_cluster, wait_until

pytestmark = pytest.mark.integration


async def _run(addr: str, requests):
    async with AsyncClient(addr) as client:
        return await asyncio.gather(
            *(
                client.generate(token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True)
                for p, n in requests
            )
        )


def test_requests_wait_for_decode_blocks(serving_model_dir, reference_engine):
    rng = random.Random(7)
    # 8 prompts of 150-200 tokens (10-13 blocks each) against a 40-block decode pool:
    # at most three fit at once, the rest must wait for blocks.
    requests = [([rng.randint(2, 500) for _ in range(rng.randint(150, 200))], 24) for _ in range(8)]
    cluster = start_cluster(
        serving_model_dir, prefill=1, decode=1, worker_args=["--num-blocks", "40"]
    )
    try:
        results = asyncio.run(_run(cluster.addr, requests))
        assert [r.token_ids for r in results] == reference_tokens(reference_engine, requests)
        assert counter(cluster, "decode0", "decode_reservations") == len(requests)
        # requests did wait: Reserve was refused for want of blocks, and retried later
        assert counter(cluster, "decode0", "decode_reservations_refused") >= 1
        wait_until(lambda: pool_idle(cluster, "decode0"), 15, "decode pool idle")
    finally:
        cluster.stop()
