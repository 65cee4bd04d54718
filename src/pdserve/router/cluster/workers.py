"""gRPC access to workers: one channel + Worker stub per address, one Streams call per address
carrying every Decode and Generate stream (streams.py), and the sending of Aborts. The call
outcomes and conversions (calls.py) are re-exported here."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from pdserve.logging import get_logger
from pdserve.rpc.channels import make_channel, metadata_with_request_id
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from .calls import (  # noqa: F401 (re-exported: the router's one place for worker calls)
    RETRYABLE,
    CallLost,
    CallTimedOut,
    RemoteError,
    cancelled_under_us,
    remote_error,
    sampling_to_proto,
    settle,
    stages_from_proto,
    ticket_from_proto,
    ticket_to_proto,
)
from .registry import Instance
from .streams import StreamHandle, WorkerStreams

log = get_logger("pdserve.router.cluster.workers")

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
        self._streams: dict[str, WorkerStreams] = {}  # the one Streams call per address
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

    def open_decode(self, address: str, request: worker_pb2.DecodeRequest) -> StreamHandle:
        """A Decode stream on the worker at `address` (its first read is the ticket)."""
        return self._streams_to(address).open(decode=request)

    def open_generate(
        self, address: str, request: worker_pb2.WorkerGenerateRequest
    ) -> StreamHandle:
        """A colocated Generate stream on the worker at `address`."""
        return self._streams_to(address).open(generate=request)

    def _streams_to(self, address: str) -> WorkerStreams:
        streams = self._streams.get(address)
        if streams is None or streams.broken is not None:
            streams = WorkerStreams(self.stub(address), address, self._forget_streams)
            self._streams[address] = streams
        return streams

    def _forget_streams(self, streams: WorkerStreams) -> None:
        if self._streams.get(streams.address) is streams:
            del self._streams[streams.address]

    def drop(self, address: str) -> None:
        """Forget the channel of an instance that left; it closes in the background after
        the calls still on it end (within `drop_grace_s`), so that those calls fail (or
        finish) on their own terms rather than all at once by the close. New calls to the
        address get a new channel (and a new Streams call: the old one ends with its
        channel, its streams still open then failing as lost)."""
        self._stubs.pop(address, None)
        self._streams.pop(address, None)
        channel = self._channels.pop(address, None)
        if channel is not None:
            task = asyncio.get_running_loop().create_task(channel.close(self._drop_grace_s))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        """Close every channel now (shutdown)."""
        channels = list(self._channels.values())
        streams = list(self._streams.values())
        self._channels.clear()
        self._stubs.clear()
        self._streams.clear()
        await asyncio.gather(*(s.aclose() for s in streams), return_exceptions=True)
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
