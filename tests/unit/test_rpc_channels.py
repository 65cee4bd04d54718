"""Channels, request-id metadata, the channel pool and the health helpers."""

from __future__ import annotations

import asyncio
import io
import socket

import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from pdserve.config import ServiceSettings
from pdserve.logging import request_id_context
from pdserve.rpc import (
    ChannelPool,
    Metrics,
    ServiceApp,
    ServiceRunner,
    check_health,
    check_health_async,
    make_channel,
    metadata_with_request_id,
)
from pdserve.rpc.channels import wait_ready
from pdserve.rpc.health_probe import main as probe_main


class Empty(ServiceApp):
    name = "empty"

    async def start(self, server: aio.Server) -> None:
        pass


@pytest.fixture
async def addr() -> str:
    runner = ServiceRunner(
        Empty(),
        ServiceSettings(port=0, grace_s=0.0),
        metrics=Metrics(CollectorRegistry()),
        ready_stream=io.StringIO(),
    )
    async with runner:
        yield runner.address


def _dead_addr() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_metadata_with_request_id() -> None:
    assert metadata_with_request_id("r1") == (("x-request-id", "r1"),)
    assert metadata_with_request_id() == ()
    with request_id_context("r2"):
        assert metadata_with_request_id(extra=[("k", "v")]) == (("k", "v"), ("x-request-id", "r2"))


async def test_pool_reuses_and_closes(addr: str) -> None:
    pool = ChannelPool()
    ch = pool.get(addr)
    assert pool.get(addr) is ch and addr in pool and len(pool) == 1
    assert await wait_ready(ch, 10)
    await pool.discard(addr)
    assert addr not in pool
    ch2 = pool.get(addr)
    assert ch2 is not ch
    await pool.close()
    assert len(pool) == 0
    with pytest.raises(RuntimeError):
        pool.get(addr)


async def test_make_channel_and_health(addr: str) -> None:
    async with make_channel(addr, options=[("grpc.keepalive_time_ms", 60_000)]) as ch:
        assert await wait_ready(ch, 10)
    assert await check_health_async(addr, timeout=10)
    assert not await check_health_async(addr, timeout=10, service="no.Such")
    # Blocking helpers run in a thread: the server lives on this loop.
    assert await asyncio.to_thread(check_health, addr, 10)
    assert await asyncio.to_thread(probe_main, [addr, "--timeout", "10"]) == 0


async def test_health_of_dead_address() -> None:
    dead = _dead_addr()
    assert not await check_health_async(dead, timeout=0.3)
    assert await asyncio.to_thread(probe_main, [dead, "--timeout", "0.3"]) == 1
    async with make_channel(dead) as ch:
        assert not await wait_ready(ch, 0.3)
