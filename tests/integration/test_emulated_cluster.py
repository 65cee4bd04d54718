"""An emulated cluster (`pdserve up --emulate h100 --model-config llama3-8b`): real worker,
router and launcher processes under mutual TLS, only the forward pass modelled. A burst of 64
requests gets exactly the emulated model's tokens and returns every KV block; a stream moves
when its decode is killed; the policy given to the router changes where requests go; no
emulated worker imports torch. The step lag is printed (reported, not asserted)."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest

from .conftest import pool_idle, wait_until, worker_info

pytestmark = pytest.mark.integration

VOCAB = 128256  # llama3-8b's
N_BURST = 64


def _cluster(**kw):
    from pdserve.launcher import Cluster, ClusterConfig

    kw.setdefault("worker_args", ["--max-num-batched-tokens", "2048", "--max-num-seqs", "128"])
    cluster = Cluster(ClusterConfig(emulate="h100", model_config="llama3-8b", port=0, **kw))
    cluster.start(timeout=180.0)
    return cluster


def _reference(requests: list[dict]) -> list[list[int]]:
    """The same emulated model in process (no clock: the fake one of a zero time scale)."""
    from pdserve.emulate.backend import EmulatedBackend, EmulateOptions, read_model_config
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    class NoWait:
        def now(self) -> float:
            return 0.0

        def sleep(self, seconds: float) -> None:
            pass

    backend = EmulatedBackend(EmulateOptions("h100", "llama3-8b"),
                              read_model_config("llama3-8b", None), clock=NoWait())  # fmt: skip
    eng = LLMEngine(EngineConfig(model_dir="", num_blocks=8192), backend=backend)
    prompts = [r["token_ids"] for r in requests]
    out = []
    for p, r in zip(prompts, requests, strict=True):
        params = SamplingParams(max_tokens=r["max_tokens"], seed=r.get("seed"), ignore_eos=True)
        out.append(eng.generate([p], params)[0])
    return out


def _requests(n: int, seed: int, max_tokens: tuple[int, int]) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        req = {
            "token_ids": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 700))],
            "max_tokens": rng.randint(*max_tokens),
            "ignore_eos": True,
        }
        if i % 3 == 0:
            req["seed"] = 100 + i
        out.append(req)
    return out


async def _run(addr: str, requests: list[dict], during=None) -> list:
    from pdserve.client import AsyncClient

    started = [False] * len(requests)

    async def one(client, i: int, req: dict):
        tokens: list[int] = []
        async for ev in client.generate_stream(**req):
            tokens += ev.token_ids
            started[i] = True
        return tokens

    async with AsyncClient(addr, timeout=120.0, max_retries=0) as client:
        tasks = [asyncio.ensure_future(one(client, i, r)) for i, r in enumerate(requests)]
        try:
            if during is not None:
                deadline = time.monotonic() + 60
                while not all(started) or not await asyncio.to_thread(during):
                    assert time.monotonic() < deadline, "the streams never all started"
                    assert not all(t.done() for t in tasks), "every stream ended first"
                    await asyncio.sleep(0.02)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.fixture(scope="module")
def emulated():
    cluster = _cluster(prefill=2, decode=2)
    try:
        yield cluster
    finally:
        cluster.stop()


def _lag_report(cluster) -> str:
    modelled = lag = steps = 0.0
    for name in cluster.worker_names():
        if not cluster.processes[name].alive:
            continue
        c = worker_info(cluster, name).counters
        modelled += c["emulate_modelled_s"]
        lag += c["emulate_lag_s"]
        steps += c["emulate_steps"]
    return f"{steps:.0f} steps, modelled {modelled:.3f} s, lag {lag / max(modelled, 1e-9):.1%}"


def test_burst_of_64_exact_tokens_every_block_returned_no_torch(emulated):
    requests = _requests(N_BURST, seed=1, max_tokens=(1, 64))
    expected = _reference(requests)
    results = asyncio.run(_run(emulated.addr, requests))
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    wrong = [i for i, (r, e) in enumerate(zip(results, expected, strict=True)) if r != e]
    assert not wrong, f"wrong tokens in {wrong}"
    for name in emulated.worker_names():
        wait_until(lambda name=name: pool_idle(emulated, name), 30, f"{name} idle")
        c = worker_info(emulated, name).counters
        assert c["emulate_torch_loaded"] == 0.0, f"{name} imported torch"
        assert c["pool_total_blocks"] > 20_000  # an H100's memory minus llama3-8b's weights
    pushed = sum(worker_info(emulated, n).counters["emulate_push_modelled_s"]
                 for n in ("prefill0", "prefill1"))  # fmt: skip
    assert pushed > 0  # KV pushes charged on the NVLink model
    print(f"\nemulated burst of {N_BURST}: {_lag_report(emulated)}")


def test_a_stream_moves_when_its_emulated_decode_is_killed(emulated):
    requests = _requests(16, seed=2, max_tokens=(300, 400))
    expected = _reference(requests)
    hit: list[str] = []

    def kill_busiest() -> bool:
        infos = {n: worker_info(emulated, n) for n in ("decode0", "decode1")}
        victim = max(infos, key=lambda n: infos[n].load.num_running)
        if infos[victim].load.num_running < 3:
            return False
        emulated.processes[victim].signal(signal.SIGKILL)
        hit.append(victim)
        return True

    results = asyncio.run(_run(emulated.addr, requests, during=kill_busiest))
    assert hit, "no decode was killed"
    failures = [r for r in results if isinstance(r, BaseException)]
    assert not failures, failures[:3]
    wrong = [i for i, (r, e) in enumerate(zip(results, expected, strict=True)) if r != e]
    assert not wrong, f"wrong tokens after the migration in {wrong}"
    for name in emulated.worker_names():
        if name != hit[0]:
            wait_until(lambda name=name: pool_idle(emulated, name), 30, f"{name} idle")


def _placements(policy: str) -> list[int]:
    """Sequences each of 3 colocated workers ran for 9 sequential requests that share a
    512-token prefix."""
    cluster = _cluster(mode="colocated", colocated=3, policy=policy)
    try:
        rng = random.Random(5)
        prefix = [rng.randrange(VOCAB) for _ in range(512)]
        reqs = [{"token_ids": prefix + [rng.randrange(VOCAB) for _ in range(20)],
                 "max_tokens": 4, "ignore_eos": True} for _ in range(9)]  # fmt: skip
        for r in reqs:
            assert not isinstance(asyncio.run(_run(cluster.addr, [r]))[0], BaseException)
        return sorted(
            int(worker_info(cluster, n).counters["emulate_sequences"])
            for n in cluster.worker_names()
        )
    finally:
        cluster.stop()


def test_swapping_the_policy_changes_the_emulated_placement():
    spread = _placements("round_robin")
    packed = _placements("prefix_aware")
    assert sum(spread) == sum(packed) == 9
    assert spread == [3, 3, 3]  # round robin: one each in turn
    assert packed[-1] >= 7  # prefix-aware: the worker that holds the prefix
