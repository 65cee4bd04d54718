"""Length-aware scheduling end to end (real processes): the router's predictions are
made wrong on purpose in both directions (oracle mode fed false lengths: far too short,
so requests outlive their KV headroom; far too long, so headroom is over-reserved),
with the overload queue and predicted-footprint placement on, and a decode pool small
enough to fill. Every request still gets exactly the in-process engine's tokens, and
every decode block comes back."""

from __future__ import annotations

import asyncio
import random

import pytest

from pdserve.client import AsyncClient

from .conftest import pool_idle, reference_tokens, start_cluster, wait_until

pytestmark = pytest.mark.integration


async def _run(addr: str, requests, claims):
    async with AsyncClient(addr) as client:
        results = await asyncio.gather(
            *(
                client.generate(
                    token_ids=p, max_tokens=n, temperature=0.0, ignore_eos=True, oracle_tokens=c
                )
                for (p, n), c in zip(requests, claims, strict=True)
            )
        )
        return results, await client.status()


def test_wrong_predictions_both_ways_keep_tokens_exact(serving_model_dir, reference_engine):
    rng = random.Random(11)
    requests = [
        ([rng.randint(2, 500) for _ in range(rng.randint(40, 90))], rng.choice([6, 40]))
        for _ in range(10)
    ]
    # under-predict the long ones (1 token), over-predict the short ones (1000 tokens)
    claims = [1 if n > 10 else 1000 for _, n in requests]
    cluster = start_cluster(
        serving_model_dir,
        prefill=1,
        decode=2,
        worker_args=["--num-blocks", "24", "--max-num-batched-tokens", "512"],
        router_args=[
            "--predictor-oracle",
            "--decode-placement",
            "predicted",
            "--reserve-max-tokens",
            "48",
            "--queue-max-running-per-decode",
            "2",
            "--queue-order",
            "sjf",
        ],
    )
    try:
        results, status = asyncio.run(_run(cluster.addr, requests, claims))
        assert [r.token_ids for r in results] == reference_tokens(reference_engine, requests)
        assert status.predictor == "oracle"
        assert status.predictor_observed == len(requests)
        assert status.queue_waiting == 0
        assert len({r.usage.decode_instance for r in results}) == 2  # both decodes used
        for name in ("decode0", "decode1"):
            wait_until(lambda name=name: pool_idle(cluster, name), 15, f"{name} pool idle")
    finally:
        cluster.stop()
