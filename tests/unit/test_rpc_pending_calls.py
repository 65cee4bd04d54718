"""Calls that reach a server while its event loop is busy wait in grpc's core until the loop
accepts them. With grpc's defaults the core drops some of them before any handler runs
(random early drop once more than 1,000 wait; a kill after 30 s): the client gets CANCELLED
and the service never sees the call, so it cannot log or count it. SERVER_OPTIONS raises
those limits, so a burst waits for the loop and reaches the service.

The server runs in its own process, its loop blocked by a handler that sleeps while the
calls arrive; the client is here: a real grpc.aio server and client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import sys

import grpc
import pytest
from grpc import aio

from pdserve.rpc.channels import PENDING_CALL_WAIT_S, PENDING_CALLS_MAX, SERVER_OPTIONS

_SERVER = """
import asyncio, json, sys, time
import grpc
from grpc import aio
from pdserve.rpc.channels import SERVER_OPTIONS

async def main():
    options = dict(SERVER_OPTIONS) if sys.argv[1] == "pdserve" else {}
    options.update(json.loads(sys.argv[2]))
    server = aio.server(options=list(options.items()))

    async def block(req, ctx):
        time.sleep(float(req.decode()))  # blocks the loop: no call is accepted meanwhile
        return b"unblocked"

    async def echo(req, ctx):
        return req

    handlers = {
        "Block": grpc.unary_unary_rpc_method_handler(block),
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
    }
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t.T", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

asyncio.run(main())
"""


async def _burst_on_a_blocked_loop(
    base: str, calls: int, block_s: float, overrides: dict[str, int] | None = None
) -> list[grpc.StatusCode]:
    """Block the server's loop for `block_s`, send `calls` calls meanwhile: their codes.
    `base`: "pdserve" (SERVER_OPTIONS) or "grpc" (grpc's defaults), plus `overrides`."""
    argv = [sys.executable, "-c", _SERVER, base, json.dumps(overrides or {})]
    proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        port = int(await proc.stdout.readline())
        async with aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            block = channel.unary_unary("/t.T/Block")
            echo = channel.unary_unary("/t.T/Echo")
            assert await echo(b"up", timeout=30) == b"up"
            blocked = asyncio.ensure_future(block(str(block_s).encode(), timeout=60))
            await asyncio.sleep(0.3)  # the server's loop is inside the sleep now

            async def one(k: int) -> grpc.StatusCode:
                try:
                    assert await echo(str(k).encode(), timeout=60) == str(k).encode()
                    return grpc.StatusCode.OK
                except aio.AioRpcError as err:
                    return err.code()

            codes = await asyncio.gather(*(one(k) for k in range(calls)))
            assert await blocked == b"unblocked"
            return list(codes)
    finally:
        proc.kill()
        await proc.wait()


@pytest.mark.slow
async def test_a_burst_of_2000_calls_waits_for_the_loop_instead_of_being_dropped() -> None:
    """2,000 calls pending at once: grpc's defaults drop a share of them (CANCELLED, no
    handler ran); SERVER_OPTIONS let every one through."""
    dropped = await _burst_on_a_blocked_loop("grpc", 2000, 2.0)
    assert grpc.StatusCode.CANCELLED in dropped, "grpc's defaults should drop some"
    assert set(dropped) <= {grpc.StatusCode.OK, grpc.StatusCode.CANCELLED}
    kept = await _burst_on_a_blocked_loop("pdserve", 2000, 2.0)
    assert kept == [grpc.StatusCode.OK] * 2000


@pytest.mark.slow
async def test_calls_left_unaccepted_past_the_wait_limit_are_cancelled() -> None:
    """The other drop: a call not accepted within the limit (1 s here) ends CANCELLED
    (the first may take the one call the server had already asked for)."""
    wait = {"grpc.server_max_unrequested_time_in_server": 1}
    codes = await _burst_on_a_blocked_loop("pdserve", 6, 2.5, wait)
    assert codes.count(grpc.StatusCode.CANCELLED) >= 5, codes


def test_server_options_raise_the_pending_limits() -> None:
    options = dict(SERVER_OPTIONS)
    assert options["grpc.server.max_pending_requests"] == PENDING_CALLS_MAX
    assert options["grpc.server.max_pending_requests_hard_limit"] == PENDING_CALLS_MAX
    assert options["grpc.server_max_unrequested_time_in_server"] == PENDING_CALL_WAIT_S
    assert PENDING_CALLS_MAX >= 16 * 1024  # grpc's defaults: 1,000 and 3,000
    assert PENDING_CALL_WAIT_S >= 600  # grpc's default: 30 s
