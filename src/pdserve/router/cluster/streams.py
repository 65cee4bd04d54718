"""The router's side of `Worker.Streams` (worker.proto): every Decode and Generate stream the
router runs on one worker goes over ONE call to it, opened on first use and kept.

`WorkerStreams` (one per worker address) has one writer task (the opens and closes queued
while a write is in flight go out together in the next message; a stream closed before its
open was written costs no message at all) and one reader task, which hands each stream's
events to its `StreamHandle` as they arrive: the worker batches a decode step's tokens for
every stream into one message.

Flow control (StreamsRequest.credit): the router grants the worker `CREDIT` messages with its
first write, and once its streams have taken in `CREDIT // 2` more messages (after the
consumers woken by the last of them ran), that many again: a credit write per few messages,
never so few that the worker waits while the router does not (a grant is due before the
worker can have spent its credit). A write that goes anyway (opens, closes) carries what was
taken in since the last grant, so a load of short requests, one open and one message each,
needs no credit-only writes. A router that falls behind thus gets fewer messages
from the worker, each carrying every token made since the last, instead of a backlog of small
messages in its socket, which its streams would drain one token at a time.

A handle reads like the per-request call it replaces, so the orchestrator's relay and its
watchdog treat both alike:
- `read()` returns the next `StreamChunk`: the ticket alone (a decode stream's first), else
  every token that arrived since the last read, merged (with the finish when it came). A
  consumer that falls behind (a busy router, a slow client) reads fewer, larger chunks.
  After the worker ended the stream without a finish: `grpc.aio.EOF`. A failed stream
  raises `StreamFailed` (a grpc.RpcError with the worker's code), once its tokens were read.
- `cancel()` leaves the stream (the worker stops it as a cancelled call) and a pending or
  later `read()` raises CancelledError, as a cancelled grpc call does.
When the call breaks (the worker died, its channel was closed), every open handle fails with
`CallLost` (UNAVAILABLE): the orchestrator retries before the first token and migrates after,
as it did for a call of its own. The next open starts a new call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve.logging import get_logger
from pdserve.v1 import worker_pb2, worker_pb2_grpc

from ..job import DecodeTicket, Stages
from .calls import CallLost, cancelled_under_us, stages_from_proto, ticket_from_proto

log = get_logger("pdserve.router.cluster.streams")


@dataclass(slots=True)
class StreamChunk:
    """What one `read()` returns: a ticket, or tokens (with the finish on the last one)."""

    token_ids: list[int]
    finish_reason: int = 0
    stages: Stages | None = None  # with finish_reason
    ticket: DecodeTicket | None = None


class StreamFailed(grpc.RpcError):
    """A stream of a Streams call ended with this status (as its own call would have)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


_CODES = {c.value[0]: c for c in grpc.StatusCode}
CREDIT = 8  # worker messages in flight at most (granted back in halves)


class StreamHandle:
    """One stream of a `WorkerStreams` call (see the module docstring)."""

    __slots__ = (
        "_cancelled", "_ended", "_error", "_finish", "_stages", "_ticket", "_tokens",
        "_waiter", "done", "stream_id", "streams",
    )  # fmt: skip

    def __init__(self, streams: WorkerStreams, stream_id: int) -> None:
        self.streams, self.stream_id = streams, stream_id
        self._tokens: list[int] = []
        self._finish = 0
        self._stages: Stages | None = None
        self._ticket: DecodeTicket | None = None
        self._error: grpc.RpcError | None = None
        self._ended = False
        self._cancelled = False
        self.done = False  # its last event arrived (or it failed, or was cancelled)
        self._waiter: asyncio.Future | None = None

    async def read(self) -> StreamChunk | object:
        while True:
            if self._cancelled:
                raise asyncio.CancelledError()
            ticket = self._ticket
            if ticket is not None:
                self._ticket = None
                return StreamChunk([], ticket=ticket)
            if self._tokens or self._finish:
                chunk = StreamChunk(self._tokens, self._finish, self._stages)
                self._tokens, self._finish = [], 0
                return chunk
            if self._error is not None:
                raise self._error
            if self._ended:
                return grpc.aio.EOF
            self._waiter = waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    def cancel(self) -> bool:
        """Leave the stream; False when it had already ended (as grpc's `cancel`)."""
        if self.done:
            return False
        self.done = self._cancelled = True
        self.streams.close(self.stream_id)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.cancel()
        return True

    # ------------------------------------------------------------ the reader's side
    def push(self, ev: worker_pb2.StreamEvent) -> bool:
        """Take one event; True when it was the stream's last."""
        if ev.token_ids:
            self._tokens.extend(ev.token_ids)
        last = True
        if ev.finish_reason:
            self._finish = ev.finish_reason
            self._stages = stages_from_proto(ev.stages)
        elif ev.status_code:
            code = _CODES.get(ev.status_code, grpc.StatusCode.UNKNOWN)
            self._error = StreamFailed(code, ev.status_message)
        elif ev.ended:
            self._ended = True
        else:
            last = False
            if ev.HasField("ticket"):
                self._ticket = ticket_from_proto(ev.ticket)
        if last:
            self.done = True
        self._wake()
        return last

    def fail(self, err: grpc.RpcError) -> None:
        """The call broke: `read()` raises `err` once the tokens that arrived were read."""
        self._error = err
        self.done = True
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class WorkerStreams:
    """The one Streams call to a worker (see the module docstring). `on_broken` is told
    once the call broke, so the next open gets a new call."""

    def __init__(
        self,
        stub: worker_pb2_grpc.WorkerStub,
        address: str,
        on_broken: Callable[[WorkerStreams], None] = lambda _s: None,
    ) -> None:
        self.address = address
        self._on_broken = on_broken
        self._handles: dict[int, StreamHandle] = {}
        self._next_id = 0
        self._opens: dict[int, worker_pb2.StreamOpen] = {}  # queued, not yet written
        self._closes: list[int] = []
        self._credit = CREDIT  # to grant with the next write
        self._taken = 0  # messages taken in since the last grant
        self._wake: asyncio.Future | None = None
        self.broken: grpc.RpcError | None = None
        self._call = stub.Streams()
        loop = asyncio.get_running_loop()
        self._reader = loop.create_task(self._read())
        self._writer = loop.create_task(self._write())

    def __len__(self) -> int:
        return len(self._handles)

    def open(
        self,
        decode: worker_pb2.DecodeRequest | None = None,
        generate: worker_pb2.WorkerGenerateRequest | None = None,
    ) -> StreamHandle:
        """A new stream running `decode` (or `generate`) on the worker."""
        self._next_id += 1
        stream_id = self._next_id
        handle = StreamHandle(self, stream_id)
        if self.broken is not None:
            handle.fail(self.broken)
            return handle
        self._handles[stream_id] = handle
        self._opens[stream_id] = worker_pb2.StreamOpen(
            stream_id=stream_id, decode=decode, generate=generate
        )
        self._kick()
        return handle

    def close(self, stream_id: int) -> None:
        """The router left the stream (its handle was cancelled)."""
        if self._handles.pop(stream_id, None) is None:
            return
        if self._opens.pop(stream_id, None) is None:  # (never written: nothing to close)
            self._closes.append(stream_id)
            self._kick()

    async def aclose(self) -> None:
        """End the call (router shutdown): every open stream fails as lost."""
        self._break(CallLost("Streams", "the router is closing"))
        await asyncio.gather(self._reader, self._writer, return_exceptions=True)

    # ------------------------------------------------------------------ tasks
    async def _write(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                if not self._opens and not self._closes and not self._credit:
                    self._wake = loop.create_future()
                    await self._wake
                    continue
                # (a write that goes anyway also grants what was taken since the last
                # grant: short requests then need no credit-only writes)
                credit = self._credit
                if self._opens or self._closes:
                    credit += self._taken
                    self._taken = 0
                msg = worker_pb2.StreamsRequest(
                    open=self._opens.values(), close=self._closes, credit=credit
                )
                self._opens, self._closes, self._credit = {}, [], 0
                await self._call.write(msg)
        except asyncio.CancelledError:
            if not cancelled_under_us():
                raise  # (_break cancelled us)
            self._break(CallLost("Streams"))
        except (grpc.RpcError, asyncio.InvalidStateError) as exc:
            self._break(_lost(exc))

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                msg = await self._call.read()
                if msg is grpc.aio.EOF:
                    raise CallLost("Streams", "the worker ended the call")
                handles = self._handles
                for ev in msg.events:
                    handle = handles.get(ev.stream_id)
                    if handle is not None and handle.push(ev):
                        del handles[ev.stream_id]
                loop.call_soon(self._grant)  # (after the consumers this message woke)
        except asyncio.CancelledError:
            if not cancelled_under_us():
                raise  # (_break cancelled us)
            self._break(CallLost("Streams"))
        except grpc.RpcError as exc:
            self._break(_lost(exc))

    def _break(self, err: grpc.RpcError) -> None:
        if self.broken is not None:
            return
        self.broken = err
        handles, self._handles = self._handles, {}
        if handles:
            log.warning(
                "worker streams call lost", address=self.address, streams=len(handles),
                error=err.details(),
            )  # fmt: skip
        for handle in handles.values():
            handle.fail(err)
        self._call.cancel()
        current = asyncio.current_task()
        for task in (self._reader, self._writer):
            if task is not current:
                task.cancel()
        self._on_broken(self)

    def _grant(self) -> None:
        self._taken += 1
        if self._taken >= CREDIT // 2 and self.broken is None:
            self._credit += self._taken
            self._taken = 0
            self._kick()

    def _kick(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)


def _lost(exc: BaseException) -> CallLost:
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        return CallLost("Streams", f"{exc.code().name}: {exc.details()}")
    return CallLost("Streams", f"{type(exc).__name__}: {exc}")
