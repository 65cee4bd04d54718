"""WorkerClients.drop against a real grpc.aio server on 127.0.0.1: a call in flight on the
channel of an instance that left finishes within the grace; without a grace the close
cancels it, and `settle` turns that into CallLost (UNAVAILABLE), not a CancelledError
that would read as the client's cancel."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pdserve.router.cluster.workers import CallLost, WorkerClients, settle
from pdserve.v1 import worker_pb2

ABORT = "/pdserve.v1.Worker/Abort"


async def _slow_abort_server(delay_s: float) -> tuple[grpc.aio.Server, str]:
    async def abort(request: bytes, context) -> bytes:
        await asyncio.sleep(delay_s)
        return worker_pb2.AbortResponse(found=True).SerializeToString()

    handler = grpc.method_handlers_generic_handler(
        "pdserve.v1.Worker",
        {"Abort": grpc.unary_unary_rpc_method_handler(abort)},  # raw bytes both ways
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _abort_while_dropped(grace_s: float):
    server, address = await _slow_abort_server(0.3)
    workers = WorkerClients(grpc.aio.insecure_channel, drop_grace_s=grace_s)
    try:
        call = workers.stub(address).Abort(worker_pb2.AbortRequest(request_id="r"), timeout=5)
        task = asyncio.ensure_future(settle(call, "Abort"))
        await asyncio.sleep(0.1)  # the call is on the wire
        workers.drop(address)
        assert workers.addresses() == []
        try:
            return await task
        finally:
            await workers.close()
    finally:
        await server.stop(None)


def test_a_call_in_flight_finishes_within_the_grace():
    resp = asyncio.run(_abort_while_dropped(grace_s=5.0))
    assert resp.found


def test_without_grace_the_close_is_the_instances_failure_not_a_cancel():
    with pytest.raises(CallLost) as err:
        asyncio.run(_abort_while_dropped(grace_s=0.0))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "Abort was cancelled" in err.value.details()
