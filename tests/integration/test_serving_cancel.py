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
