"""Cancelling a stream mid-way frees the decode's blocks, and the next request still works."""

from __future__ import annotations

import asyncio

import pytest

from .conftest import pool_idle, reference_tokens, wait_until

pytestmark = pytest.mark.integration

PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks


async def _stream_then_cancel(addr: str, how: str) -> list[int]:
    from pdserve.client import AsyncClient

    got: list[int] = []
    async with AsyncClient(addr, timeout=60.0) as client:
        stream = client.generate_stream(
            token_ids=PROMPT, max_tokens=200, temperature=0.0, ignore_eos=True
        )
        if how == "break":
            async for ev in stream:
                got.extend(ev.token_ids)
                if len(got) >= 3:
                    break
            await stream.aclose()
        else:  # cancel the consuming task
            three = asyncio.Event()

            async def consume() -> None:
                async for ev in stream:
                    got.extend(ev.token_ids)
                    if len(got) >= 3:
                        three.set()

            task = asyncio.create_task(consume())
            await asyncio.wait(
                [task, asyncio.create_task(three.wait())],
                timeout=60.0,
                return_when=asyncio.FIRST_COMPLETED,
            )
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return got


def _test_cancel(cluster, reference_engine, how: str) -> None:
    from pdserve.client import Client

    wait_until(lambda: pool_idle(cluster, "decode0"), 30, "decode idle before the test")
    got = asyncio.run(_stream_then_cancel(cluster.addr, how))
    assert 3 <= len(got) < 200, "the stream should have been cut after a few tokens"
    (expected,) = reference_tokens(reference_engine, [(PROMPT, 200)])
    assert got == expected[: len(got)]
    # the router aborts the decode; its blocks (and any reservation) come back
    wait_until(lambda: pool_idle(cluster, "decode0"), 30, "decode pool back to idle")
    res = Client(cluster.addr, timeout=60.0).generate(
        token_ids=PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True
    )
    assert res.token_ids == expected[:8]
    wait_until(lambda: pool_idle(cluster, "decode0"), 30, "decode pool idle after a request")


def test_break_out_of_stream_frees_blocks(cluster_1p1d, reference_engine):
    _test_cancel(cluster_1p1d, reference_engine, "break")


def test_cancelled_task_frees_blocks(cluster_1p1d, reference_engine):
    _test_cancel(cluster_1p1d, reference_engine, "cancel")


# A router that opens a Decode stream on the decode (its one Streams call, with the router's
# certificate), holds the reservation, says so, and waits to be killed.
ROUTER_STAND_IN = """
import asyncio, sys
from pdserve.router.cluster.workers import WorkerClients
from pdserve.rpc.tls import TlsFiles, configure_client
from pdserve.v1 import common_pb2, worker_pb2

async def main(address, tls_dir):
    configure_client(TlsFiles.in_dir(tls_dir, "router") if tls_dir else None)
    request = worker_pb2.DecodeRequest(
        request_id="router-dies", prompt_token_ids=list(range(3, 43)),
        sampling=common_pb2.SamplingParams(max_tokens=200, temperature=0.0),
    )
    handle = WorkerClients().open_decode(address, request)
    msg = await handle.read()
    print("ticket" if msg.ticket is not None else "no ticket", flush=True)
    await asyncio.sleep(600)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def test_a_dead_router_frees_its_streams_kv_on_the_decode(cluster_1p1d):
    """The router carrying a stream dies (SIGKILL): its connection to the decode is gone,
    and the decode frees the stream's blocks at once, not when the lease (120 s) ends."""
    import subprocess
    import sys

    cluster = cluster_1p1d
    wait_until(lambda: pool_idle(cluster, "decode0"), 30, "decode idle before the test")
    address = f"127.0.0.1:{cluster.processes['decode0'].port}"
    tls_dir = str(cluster.tls_dir) if cluster.tls_dir else ""
    router = subprocess.Popen(
        [sys.executable, "-c", ROUTER_STAND_IN, address, tls_dir],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert router.stdout is not None and router.stdout.readline().strip() == "ticket"
        assert not pool_idle(cluster, "decode0")  # the reservation holds blocks
        router.kill()
        router.wait(10)
        wait_until(lambda: pool_idle(cluster, "decode0"), 10, "decode pool idle after the kill")
    finally:
        router.kill()
        router.wait(10)
