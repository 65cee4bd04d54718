"""The worker's side of `Worker.Streams`: many Decode and Generate streams over one call per
(router, worker) (worker.proto).

`StreamMux` serves one such call:

- each `StreamOpen` starts a task that runs the stream exactly as its own Decode or Generate
  call would (`opener`: the servicer's checks, role gating, reservation); the request id is
  bound in the task's context, so every log line of the stream carries it;
- a `close` cancels that task, as a router leaving a call does: the handlers' `finally`
  blocks free what the stream holds;
- what the tasks yield is queued as `StreamEvent`s in the next outgoing message, and ONE
  writer sends it: each write carries everything queued since the previous write began. A
  decode step makes a token for every running stream; their events all land in one message,
  and more merge while a write is in flight (a stream's token events in one message merge
  into one event). Once the router grants credit (StreamsRequest.credit), the writer also
  waits for a credit before each write: a router that falls behind then receives every
  token made meanwhile in one message, not a backlog of small ones in its socket;
- the end of the call (the router closed it, died, or its connection broke) cancels every
  stream task, so their KV is freed at once, not at lease expiry.

Invariant: a stream's events go out in order and end with exactly one terminal event
(finish_reason, status_code or ended set), unless the router closed the stream or the call
ended (then nothing more is sent for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Callable

import grpc

from pdserve.errors import InvalidRequestError, PdserveError
from pdserve.logging import get_logger, request_id_var
from pdserve.rpc.ids import is_valid_id
from pdserve.rpc.interceptor import status_for
from pdserve.v1 import worker_pb2
from pdserve.worker import convert
from pdserve.worker.domain import Ticket, TokenEvent

_log = get_logger(__name__)

Opener = Callable[[worker_pb2.StreamOpen], AsyncIterator[Ticket | TokenEvent]]


def _request_id(o: worker_pb2.StreamOpen) -> str:
    kind = o.WhichOneof("kind")
    return getattr(o, kind).request_id if kind else ""


class StreamMux:
    """Serves one Streams call (see the module docstring)."""

    def __init__(self, opener: Opener) -> None:
        self._opener = opener
        self._tasks: dict[int, asyncio.Task] = {}
        self._batch = worker_pb2.StreamsEvents()  # the next message
        self._mergeable: dict[int, worker_pb2.StreamEvent] = {}  # stream -> its event in it
        self._wake: asyncio.Future | None = None
        self._paced = False  # the router grants credit: write only while holding one
        self._credit = 0

    @property
    def num_streams(self) -> int:
        return len(self._tasks)

    async def serve(self, context: grpc.aio.ServicerContext) -> None:
        """Read opens and closes, write events, until the router ends the call (and every
        stream ended) or the call breaks; then stop every stream still running. The call
        cancelled (the router went away, or this worker's server is stopping) ends it
        quietly: there is nobody left to tell."""
        with contextlib.suppress(asyncio.CancelledError):  # (grpc would log it as an error)
            await self._serve(context)

    async def _serve(self, context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        reader = loop.create_task(self._read(context))
        reader.add_done_callback(lambda _t: self._kick())
        try:
            while True:
                if not self._batch.events or (self._paced and self._credit <= 0):
                    if reader.done() and not self._tasks and not self._batch.events:
                        break
                    self._wake = loop.create_future()
                    await self._wake
                    continue
                batch, self._batch = self._batch, worker_pb2.StreamsEvents()
                self._mergeable.clear()
                if self._paced:
                    self._credit -= 1
                await context.write(batch)
            reader.result()  # (raises what ended the reads, if anything did)
        finally:
            reader.cancel()
            for task in list(self._tasks.values()):
                task.cancel()  # the call is over: each stream frees what it holds

    async def _read(self, context: grpc.aio.ServicerContext) -> None:
        while True:
            req = await context.read()
            if req is grpc.aio.EOF:  # the router sends nothing more; running streams go on
                self._paced = False  # (no credit can come any more)
                return
            if req.credit:
                self._paced = True
                self._credit += req.credit
                self._kick()
            for o in req.open:
                self._open(o)
            for stream_id in req.close:
                task = self._tasks.pop(stream_id, None)
                if task is not None:
                    task.cancel()

    # ------------------------------------------------------------------ streams
    def _open(self, o: worker_pb2.StreamOpen) -> None:
        stream_id = o.stream_id
        if stream_id in self._tasks:
            self._failed(
                stream_id, InvalidRequestError("stream_id", f"{stream_id} is already open")
            )
            return
        rid = _request_id(o)
        ctx = contextvars.copy_context()
        ctx.run(request_id_var.set, rid if is_valid_id(rid) else None)
        task = asyncio.get_running_loop().create_task(self._run(stream_id, o), context=ctx)
        self._tasks[stream_id] = task

    async def _run(self, stream_id: int, o: worker_pb2.StreamOpen) -> None:
        try:
            events = self._opener(o)
            async with contextlib.aclosing(events):
                async for ev in events:
                    if self._emit(stream_id, ev):
                        return
            self._event(stream_id, mergeable=True).ended = True
        except asyncio.CancelledError:
            raise  # closed by the router, or the call ended: nothing more to send
        except Exception as exc:
            self._failed(stream_id, exc)
        finally:
            if self._tasks.get(stream_id) is asyncio.current_task():
                del self._tasks[stream_id]
                if not self._tasks:
                    self._kick()  # (serve may be waiting for the last stream to end)

    # ------------------------------------------------------------------ events
    def _emit(self, stream_id: int, ev: Ticket | TokenEvent) -> bool:
        """Queue `ev`; True when it ends the stream (it carries the finish)."""
        if isinstance(ev, Ticket):
            self._event(stream_id, mergeable=False).ticket.CopyFrom(convert.ticket_to_proto(ev))
            return False
        event = self._event(stream_id, mergeable=True)
        event.token_ids.extend(ev.token_ids)
        if ev.finish_reason is None:
            return False
        event.finish_reason = convert.FINISH_TO_PROTO.get(ev.finish_reason, 0)
        if ev.stages is not None:
            event.stages.CopyFrom(convert.stages_to_proto(ev.stages))
        return True

    def _failed(self, stream_id: int, exc: Exception) -> None:
        """The stream failed: its status, as the call's would be (logged as the error
        interceptor logs a failed call)."""
        code, details = status_for(exc)
        if isinstance(exc, PdserveError):
            _log.info("stream failed", code=code.name, details=details)
        elif code is grpc.StatusCode.INTERNAL:
            _log.error("stream crashed", code=code.name, exc_info=exc)
        else:
            _log.warning("stream failed upstream", code=code.name, details=details)
        event = self._event(stream_id, mergeable=False)
        event.status_code = code.value[0]
        event.status_message = details

    def _event(self, stream_id: int, mergeable: bool) -> worker_pb2.StreamEvent:
        """The stream's event in the next message: its last one there when `mergeable` (token
        events merge), else a new one (a ticket, a failure), after which nothing merges."""
        if mergeable:
            event = self._mergeable.get(stream_id)
            if event is not None:
                return event
        event = self._batch.events.add(stream_id=stream_id)
        if mergeable:
            self._mergeable[stream_id] = event
        else:
            self._mergeable.pop(stream_id, None)
        self._kick()
        return event

    def _kick(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)
