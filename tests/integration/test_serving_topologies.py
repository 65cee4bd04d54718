"""End to end through real processes: 32 concurrent greedy requests of mixed lengths on
2P1D, 1P2D and 2 colocated workers give exactly the in-process engine's tokens, and the
decodes received exactly the KV bytes those prompts imply.

KV bytes: for a prompt of n tokens the prefill pushes, per layer, the request's first
ceil(n / block_size) blocks (engine `_sink_callback`: `block_table[:num_blocks_for(n)]`); the
decode posts one receive of that size per layer (decode.py `Reservation.staging`). Summed over
layers that is ceil(n / block_size) * bytes_per_block (WorkerInfo.bytes_per_block). A 1-token
request is prefill only: no decode, no KV pushed."""

from __future__ import annotations

import asyncio
import math

import pytest

from pdserve.worker.nonce import TOKEN_MESSAGE_INT32

from .conftest import BLOCK_SIZE, counter, mixed_requests, reference_tokens, start_cluster
from .conftest import worker_info as info_of

pytestmark = pytest.mark.integration

TOPOLOGIES = {
    "2p1d": dict(mode="disagg", prefill=2, decode=1),
    "1p2d": dict(mode="disagg", prefill=1, decode=2),
    "colocated": dict(mode="colocated", colocated=2),
}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def topology(request, serving_model_dir):
    cluster = start_cluster(serving_model_dir, **TOPOLOGIES[request.param])
    try:
        yield request.param, cluster
    finally:
        cluster.stop()


async def _run_all(addr: str, requests: list[tuple[list[int], int]]):
    from pdserve.client import AsyncClient

    async with AsyncClient(addr, timeout=120.0) as client:
        return await asyncio.gather(
            *(
                client.generate(
                    token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                )
                for prompt, max_tokens in requests
            )
        )


def _receivers(cluster) -> list[str]:
    return [n for n in cluster.worker_names() if n.startswith(("decode", "colocated"))]


def test_concurrent_greedy_matches_engine_and_kv_bytes(topology, reference_engine):
    name, cluster = topology
    requests = mixed_requests(32, seed=7)
    requests[:3] = [(p, 1) for p, _ in requests[:3]]  # three 1-token requests (prefill only)
    expected = reference_tokens(reference_engine, requests)
    before = {n: counter(cluster, n, "ucx_bytes_received") for n in _receivers(cluster)}

    results = asyncio.run(_run_all(cluster.addr, requests))

    for i, ((prompt, max_tokens), res, ref) in enumerate(
        zip(requests, results, expected, strict=True)
    ):
        assert res.token_ids == ref, f"request {i} (prompt {len(prompt)} tokens) differs"
        assert len(res.token_ids) == max_tokens
        assert res.finish_reason == "length"
        assert res.prompt_tokens == len(prompt)

    received = sum(
        counter(cluster, n, "ucx_bytes_received") - before[n] for n in _receivers(cluster)
    )
    if name == "colocated":
        assert received == 0  # no KV crosses processes
        return
    info = info_of(cluster, _receivers(cluster)[0])
    assert info.block_size == BLOCK_SIZE
    bytes_per_block = info.bytes_per_block
    # the spec's formula, recomputed from the model's shape (float32 K and V, every layer)
    assert bytes_per_block == info.num_layers * 2 * BLOCK_SIZE * 2 * 16 * 4
    pushed = [(p, m) for p, m in requests if m > 1]
    implied = sum(math.ceil(len(p) / BLOCK_SIZE) * bytes_per_block for p, _ in pushed)
    # + token 0 of each request and its ticket's nonce (one int32 message: early admission,
    # worker.proto Ticket; pdserve.worker.nonce). Every KV byte arrives, exactly once.
    token_msg = 4 * TOKEN_MESSAGE_INT32
    assert received == implied + token_msg * len(pushed)
    # each request reports the bytes of its own transfer (usage.stages.transfer_bytes)
    for (prompt, max_tokens), res in zip(requests, results, strict=True):
        blocks = math.ceil(len(prompt) / BLOCK_SIZE) if max_tokens > 1 else 0
        assert res.usage.stages["transfer_bytes"] == blocks * bytes_per_block
