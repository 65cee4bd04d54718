"""gRPC access to workers: one channel + Worker stub per address, the
request-id metadata, the mapping of a worker's RPC error to a domain error, and
the sending of Aborts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from pdserve.errors import PdserveError
from pdserve.logging import get_logger
from pdserve.rpc.channels import make_channel, metadata_with_request_id
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from .registry import Instance

log = get_logger("pdserve.router.workers")

# Worker failures after which another instance may succeed.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


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


class WorkerClients:
    def __init__(self, channel_factory: Callable[[str], grpc.aio.Channel] | None = None) -> None:
        self._factory = channel_factory or make_channel
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = self._factory(address)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    def addresses(self) -> list[str]:
        return list(self._channels)

    async def drop(self, address: str) -> None:
        """Close the channel of an instance that left."""
        self._stubs.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            await channel.close()

    async def close(self) -> None:
        for address in list(self._channels):
            await self.drop(address)


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
        except grpc.RpcError as err:
            log.info("abort failed", instance=inst.instance_id, code=str(err.code()))

    def later(self, inst: Instance, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self.now(inst, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
