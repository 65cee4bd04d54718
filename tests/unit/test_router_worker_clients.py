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


def test_domain_types_convert_at_the_worker_client_boundary():
    """The core holds DecodeTicket, Stages and SamplingParams; workers get every field."""
    from pdserve.engine.params import SamplingParams
    from pdserve.router.cluster.workers import (
        sampling_to_proto,
        stages_from_proto,
        ticket_from_proto,
        ticket_to_proto,
    )
    from pdserve.v1 import common_pb2, worker_pb2
    from pdserve.worker.convert import sampling_from_proto

    wire = worker_pb2.Ticket(
        ticket_id=9, decode_instance_id="d", ucx_worker_address=b"ucx", tag_base=9 << 16,
        lease_expiry_unix_s=12.5, num_blocks=3, kv_fingerprint="fp",
        nonce=b"n" * 16,
    )  # fmt: skip
    assert ticket_to_proto(ticket_from_proto(wire)) == wire
    assert ticket_to_proto(None) is None
    params = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.75, top_k=4, seed=3,
                            stop_token_ids=(2, 5), ignore_eos=True, output_offset=11)  # fmt: skip
    # what the worker reads (floats exact in float32: the wire type)
    assert sampling_from_proto(sampling_to_proto(params)) == params
    assert not sampling_to_proto(SamplingParams()).HasField("seed")
    costs = common_pb2.StageCosts(prefill_ms=1.5, transfer_bytes=10, cached_tokens=4)
    st = stages_from_proto(costs)
    assert (st.prefill_ms, st.transfer_bytes, st.cached_tokens) == (1.5, 10, 4)
    st.add(stages_from_proto(costs), skip=st.PROMPT_ONLY)
    assert (st.prefill_ms, st.cached_tokens) == (3.0, 4)
