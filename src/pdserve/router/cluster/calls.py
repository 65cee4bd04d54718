"""What a worker call's outcome means to the router, and the proto <-> domain conversions of
the worker calls: `CallLost` / `CallTimedOut` (a call ended by its instance going away, or
silent past its deadline), `RemoteError` (a worker's status, relayed with its code),
`settle` (await a unary call; a cancel of the call itself is `CallLost`)."""

from __future__ import annotations

import asyncio

import grpc

from pdserve.engine.params import SamplingParams
from pdserve.errors import PdserveError
from pdserve.v1 import common_pb2, worker_pb2

from ..job import DecodeTicket, Stages

# Worker failures after which another instance may succeed.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class CallLost(grpc.RpcError):
    """A worker call ended without an answer because its instance went away: cancelled
    although nobody cancelled the task awaiting it (the router closed the channel of an
    instance that expired), or, for a stream, lost before its first message. It reads as
    UNAVAILABLE, so the caller retries or migrates instead of taking it for its own
    cancellation (which would end the client's request)."""

    def __init__(
        self, what: str = "worker call", why: str = "the instance left the registry"
    ) -> None:
        super().__init__(what)
        self._details = f"{what} was cancelled: {why}"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return self._details


class CallTimedOut(grpc.RpcError):
    """A worker stream sent no message within its deadline (DEADLINE_EXCEEDED: retryable)."""

    def __init__(self, what: str, why: str, timeout_s: float) -> None:
        super().__init__(what)
        self._details = f"{what} {why} within {timeout_s:g} s"

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return self._details


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    """The router's validated params as workers receive them (every field explicit)."""
    sp = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        output_offset=params.output_offset,
    )
    if params.seed is not None:
        sp.seed = params.seed
    return sp


_TICKET_FIELDS = tuple(DecodeTicket.__dataclass_fields__)


def ticket_from_proto(msg: worker_pb2.Ticket) -> DecodeTicket:
    return DecodeTicket(**{f: getattr(msg, f) for f in _TICKET_FIELDS})


def ticket_to_proto(ticket: DecodeTicket | None) -> worker_pb2.Ticket | None:
    if ticket is None:
        return None
    return worker_pb2.Ticket(**{f: getattr(ticket, f) for f in _TICKET_FIELDS})


def stages_from_proto(msg: common_pb2.StageCosts) -> Stages:
    """A worker's StageCosts as the router's `Stages`."""
    return Stages(
        queue_ms=msg.queue_ms,
        prefill_ms=msg.prefill_ms,
        transfer_ms=msg.transfer_ms,
        transfer_bytes=msg.transfer_bytes,
        decode_ms=msg.decode_ms,
        cached_tokens=msg.cached_tokens,
        kvstore_tokens=msg.kvstore_tokens,
    )


def cancelled_under_us() -> bool:
    """True inside `except CancelledError` when the cancellation came from the call (or
    channel) awaited, not from a cancel of the current task."""
    task = asyncio.current_task()
    return task is not None and not task.cancelling()


async def settle(call, what: str = "worker call"):
    """Await a unary worker call; a cancel of the call itself (not of us) becomes
    `CallLost`."""
    try:
        return await call
    except asyncio.CancelledError:
        if cancelled_under_us():
            raise CallLost(what) from None
        raise


class RemoteError(PdserveError):
    """A worker's status, relayed with its code (the interceptor maps `code`)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def remote_error(err: grpc.RpcError, what: str) -> RemoteError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    if code == grpc.StatusCode.UNKNOWN:
        code = grpc.StatusCode.INTERNAL
    return RemoteError(code, f"{what}: {details}")
