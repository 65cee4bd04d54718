"""gRPC access to workers: one channel + Worker stub per address, the
request-id metadata, the mapping of a worker's RPC error to a domain error, and
the sending of Aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from pdserve.engine.params import SamplingParams
from pdserve.errors import PdserveError
from pdserve.logging import get_logger
from pdserve.rpc.channels import make_channel, metadata_with_request_id
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc

from ..job import DecodeTicket, Stages
from .registry import Instance

log = get_logger("pdserve.router.cluster.workers")

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


# How long the calls still running on a dropped instance's channel may take before the
# channel is closed (which cancels them).
DROP_GRACE_S = 10.0


class WorkerClients:
    def __init__(
        self,
        channel_factory: Callable[[str], grpc.aio.Channel] | None = None,
        drop_grace_s: float = DROP_GRACE_S,
    ) -> None:
        self._factory = channel_factory or make_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._drop_grace_s = drop_grace_s
        self._closing: set[asyncio.Task] = set()  # dropped channels closing in the background

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._factory(address)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def addresses(self) -> list[str]:
        return list(self._channels)

    def drop(self, address: str) -> None:
        """Forget the channel of an instance that left; it closes in the background after
        the calls still on it end (within `drop_grace_s`), so that those calls fail (or
        finish) on their own terms rather than all at once by the close. New calls to the
        address get a new channel."""
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(channel.close(self._drop_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every channel now (shutdown)."""
        channels = list(self._channels.values())
        self._channels.clear()
        self._stubs.clear()
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)
        for channel in channels:
            await channel.close()


class Aborter:
    """Sends Abort(request_id) to workers; `later` does it in a background task (safe to
    call while being cancelled), `wait` lets shutdown finish the pending ones."""

    def __init__(self, workers: WorkerClients, timeout_s: float) -> None:
        self._workers = workers
        self._timeout_s = timeout_s
        self._background: set[asyncio.Task] = set()

    async def now(self, inst: Instance, request_id: str) -> None:
        try:
            await self._workers.stub(inst.address).Abort(
                worker_pb2.AbortRequest(request_id=request_id),
                timeout=self._timeout_s,
                metadata=metadata_with_request_id(request_id),
            )
        except asyncio.CancelledError:
            if not cancelled_under_us():
                raise
            log.info("abort failed", instance=inst.instance_id, code="CANCELLED")
        except grpc.RpcError as err:
            log.info("abort failed", instance=inst.instance_id, code=str(err.code()))

    def later(self, inst: Instance, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.now(inst, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
