"""The conformance scenario on a served cluster: one `pdserve up`-style 1P1D cluster of a tiny
qwen2 in the DEFAULT dtype (auto: bfloat16 on a CPU with AVX512-BF16/AMX), 16 requests sent
one by one, then all at once: identical tokens, and identical to the in-process engine (same
dtype, each request alone). Greedy and seeded sampling (temperature 0.8) requests mixed.

Before batch invariance, 3 of these 16 changed tokens when sent together in bf16. The
in-process variant of this check, with the batch-variant engine failing it, is
tests/unit/test_conformance.py."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import start_cluster

pytestmark = pytest.mark.integration


def _requests() -> list[dict]:
    import random

    rng = random.Random(17)
    out = []
    for i in range(16):
        n = 1 + (i * 37) % 200
        req = dict(token_ids=[rng.randint(2, 511) for _ in range(n)], max_tokens=16)
        if i % 2:
            req |= dict(temperature=0.8, top_p=0.9, seed=1000 + i)
        else:
            req |= dict(temperature=0.0)
        out.append(req | dict(ignore_eos=True))
    return out


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from pdserve.model.tiny import TinySpec, make_tiny

    root = tmp_path_factory.mktemp("served-conformance")
    return make_tiny(root / "qwen2", TinySpec(family="qwen2", vocab=512, max_pos=1024))


@pytest.fixture(scope="module")
def cluster(qwen2_dir):
    # --dtype auto: the serving default (tests/conftest.py pins float32 for other tests)
    c = start_cluster(qwen2_dir, prefill=1, decode=1, worker_args=["--dtype=auto"])
    try:
        yield c
    finally:
        c.stop()


async def _one_by_one(addr: str, reqs: list[dict]) -> list[list[int]]:
    from pdserve.client import AsyncClient

    async with AsyncClient(addr, timeout=120.0) as client:
        return [(await client.generate(**r)).token_ids for r in reqs]


async def _all_at_once(addr: str, reqs: list[dict]) -> list[list[int]]:
    from pdserve.client import AsyncClient

    async with AsyncClient(addr, timeout=120.0) as client:
        results = await asyncio.gather(*(client.generate(**r) for r in reqs))
    return [r.token_ids for r in results]


def _in_process(model_dir, reqs: list[dict]) -> list[list[int]]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir, dtype="auto", enable_prefix_caching=False))
    out = []
    for r in reqs:
        params = SamplingParams(
            max_tokens=r["max_tokens"],
            temperature=r["temperature"],
            top_p=r.get("top_p", 1.0),
            seed=r.get("seed"),
            ignore_eos=True,
        )
        out.append(engine.generate([r["token_ids"]], params)[0])
    return out


def test_sixteen_requests_one_by_one_then_all_at_once(cluster, qwen2_dir):
    reqs = _requests()
    alone = asyncio.run(_one_by_one(cluster.addr, reqs))
    together = asyncio.run(_all_at_once(cluster.addr, reqs))
    same = sum(a == b for a, b in zip(alone, together, strict=True))
    assert same == 16, f"{same}/16 identical one by one vs all at once"
    assert all(len(t) == 16 for t in alone)
    assert _in_process(qwen2_dir, reqs) == alone, "served (disaggregated) vs in-process"
