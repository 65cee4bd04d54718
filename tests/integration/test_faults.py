"""Faults on a real 2P1D cluster: a prefill worker killed with requests stuck on it, then the
only decode worker killed mid-stream, then restarted. Every wait is bounded."""

from __future__ import annotations

import asyncio
import signal
import time

import pytest

from .conftest import counter, pool_idle, reference_tokens, start_cluster, wait_until, worker_info

pytestmark = pytest.mark.integration

HANG_GUARD_S = 15.0  # "promptly": an upper bound against hangs, not a latency claim


@pytest.fixture(scope="module")
def cluster(serving_model_dir):
    c = start_cluster(
        serving_model_dir,
        prefill=2,
        decode=1,
        worker_args=["--num-blocks", "256", "--lease-s", "3"],
        # The only decode dies and nothing restarts it here: a stream waits this long for
        # another decode to continue on (migration), then fails.
        router_args=["--migration-wait-s", "2"],
    )
    try:
        yield c
    finally:
        c.stop()


def _long_requests(n: int) -> list[tuple[list[int], int]]:
    return [([2 + (i * 7 + j) % 500 for j in range(150 + i)], 12) for i in range(n)]


async def _generate_all(addr: str, requests, timeout: float = 90.0):
    from pdserve.client import AsyncClient

    async with AsyncClient(addr, timeout=timeout) as client:
        coros = [
            client.generate(token_ids=p, max_tokens=m, temperature=0.0, ignore_eos=True)
            for p, m in requests
        ]
        return await asyncio.gather(*coros, return_exceptions=True)


def test_prefill_killed_with_requests_in_flight(cluster, reference_engine):
    requests = _long_requests(8)
    expected = reference_tokens(reference_engine, requests)
    survivor = worker_info(cluster, "prefill1").instance_id
    reservations0 = counter(cluster, "decode0", "decode_reservations")
    expired0 = counter(cluster, "decode0", "decode_leases_expired")
    # Freeze prefill0 so that the requests routed to it are certainly in flight there
    # (its socket still accepts the calls), then kill -9 it while they wait.
    cluster.processes["prefill0"].signal(signal.SIGSTOP)
    try:

        async def scenario():
            task = asyncio.ensure_future(_generate_all(cluster.addr, requests))
            # wait (bounded) until some request holds a decode reservation while prefilling
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not task.done():
                info = await asyncio.to_thread(worker_info, cluster, "decode0")
                if info.load.num_reserved > 0:
                    break
                await asyncio.sleep(0.05)
            await asyncio.to_thread(cluster.kill, "prefill0")
            return await asyncio.wait_for(task, 120)

        results = asyncio.run(scenario())
    finally:
        cluster.processes["prefill0"].signal(signal.SIGKILL)
    assert not cluster.processes["prefill0"].alive
    for i, (res, ref) in enumerate(zip(results, expected, strict=True)):
        assert not isinstance(res, BaseException), f"request {i} failed: {res!r}"
        assert res.token_ids == ref, f"request {i}: wrong tokens"
        assert res.usage.prefill_instance == survivor  # retried on the other prefill worker
    # at least one request was re-reserved after its prefill on prefill0 failed
    assert counter(cluster, "decode0", "decode_reservations") - reservations0 > len(requests)
    # the lost transfers' reservations come back: the router Aborts the ticket (awaited) before
    # it re-reserves, so no lease has to expire
    wait_until(lambda: pool_idle(cluster, "decode0"), 30, "decode blocks back after the kill")
    assert counter(cluster, "decode0", "decode_leases_expired") == expired0


async def _stream(addr: str, prompt: list[int], started: asyncio.Event) -> None:
    from pdserve.client import AsyncClient

    async with AsyncClient(addr, timeout=120.0, max_retries=0) as client:
        async for _ev in client.generate_stream(
            token_ids=prompt, max_tokens=200, temperature=0.0, ignore_eos=True
        ):
            started.set()


PROMPT = list(range(3, 43))


async def _after_kill(cluster, streams: list[asyncio.Future], then=None):
    """Kill decode0 (then run `then`); return (stream outcomes, s until all ended, the error
    of a fresh request, s it took)."""
    from pdserve.client import AsyncClient, PdserveClientError

    killed_at = time.monotonic()
    await asyncio.to_thread(cluster.kill, "decode0")
    if then is not None:
        then()
    outcomes = await asyncio.wait_for(asyncio.gather(*streams, return_exceptions=True), 60)
    ended_after = time.monotonic() - killed_at
    t0 = time.monotonic()
    error: BaseException | None = None
    async with AsyncClient(cluster.addr, timeout=60.0) as client:
        try:
            await client.generate(token_ids=PROMPT, max_tokens=4, temperature=0.0)
        except PdserveClientError as exc:
            error = exc
    return outcomes, ended_after, error, time.monotonic() - t0


def _check_unavailable(outcome) -> None:
    from pdserve.client import Unavailable

    outcomes, ended_after, error, error_after = outcome
    for res in outcomes:  # each stream fails: an error, never a silent "finished" or a hang
        assert isinstance(res, Unavailable), repr(res)
    assert ended_after < HANG_GUARD_S
    assert isinstance(error, Unavailable), repr(error)  # no decode instance left
    assert error_after < HANG_GUARD_S


def _restart_and_serve(cluster, reference_engine) -> None:
    from pdserve.client import Client, Unavailable

    cluster.restart("decode0")
    got: list[list[int]] = []

    def serves() -> bool:
        try:
            with Client(cluster.addr, timeout=30.0) as c:
                res = c.generate(token_ids=PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
        except Unavailable:
            return False  # the router may still hold the dead instance for a moment
        got.append(res.token_ids)
        return True

    wait_until(serves, 30, "the restarted decode serves")
    assert got[-1] == reference_tokens(reference_engine, [(PROMPT, 6)])[0]
    assert worker_info(cluster, "decode0").counters["decode_admitted"] >= 1
    wait_until(lambda: pool_idle(cluster, "decode0"), 30, "restarted decode idle")


def test_decode_killed_while_prefill_pushes_kv(cluster, reference_engine):
    """Requests reserved on decode0 wait on frozen prefills; decode0 dies, the prefill resumes
    and pushes KV to a dead peer. The router must not wait for the prefill's transfer
    timeout: the decode stopped heartbeating, so the prefill is cancelled (UNAVAILABLE)."""
    frozen = [cluster.processes[n] for n in ("prefill0", "prefill1")]
    frozen = [p for p in frozen if p.alive]
    old_id = worker_info(cluster, "decode0").instance_id

    async def scenario():
        for p in frozen:
            p.signal(signal.SIGSTOP)
        try:
            started = asyncio.Event()
            streams = [
                asyncio.ensure_future(_stream(cluster.addr, PROMPT, started)) for _ in range(3)
            ]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                info = await asyncio.to_thread(worker_info, cluster, "decode0")
                if info.load.num_reserved >= 3:
                    break
                await asyncio.sleep(0.05)
            assert not started.is_set()
        except BaseException:
            for p in frozen:
                p.signal(signal.SIGCONT)
            raise

        def resume() -> None:
            for p in frozen:
                p.signal(signal.SIGCONT)

        return await _after_kill(cluster, streams, then=resume)

    _check_unavailable(asyncio.run(scenario()))
    _restart_and_serve(cluster, reference_engine)
    assert worker_info(cluster, "decode0").instance_id != old_id


def test_decode_killed_mid_stream(cluster, reference_engine):
    async def scenario():
        started = asyncio.Event()
        streams = [asyncio.ensure_future(_stream(cluster.addr, PROMPT, started)) for _ in range(3)]
        await asyncio.wait_for(started.wait(), 60)
        return await _after_kill(cluster, streams)

    _check_unavailable(asyncio.run(scenario()))
    _restart_and_serve(cluster, reference_engine)
