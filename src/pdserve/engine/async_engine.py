"""AsyncEngine: the LLMEngine on its own thread, with an asyncio front.

The engine thread loops: run queued commands, then one `step()` if any request is unfinished;
with nothing to do it sleeps on a condition (never spins). Every engine call from asyncio
goes through the command queue, so the engine is only ever touched by its thread. Results
cross back to the event loop with `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

from pdserve.engine.engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.engine.params import SamplingParams
from pdserve.errors import UnavailableError

T = TypeVar("T")
_Stream = tuple[asyncio.AbstractEventLoop, asyncio.Queue]


def _resolve(fut: asyncio.Future, result: Any, exc: BaseException | None) -> None:
    if fut.done():  # the awaiting task was cancelled
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: deque[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future]]
        self._commands = deque()
        self._streams: dict[str, _Stream] = {}  # engine-thread only
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side -----------------------------------------------------------------
    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn()` on the engine thread between steps; return (or raise) its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._cond:
            if self._stopped:
                raise UnavailableError("engine is shut down")
            self._commands.append((fn, loop, fut))
            self._cond.notify()
        return await fut

    def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs; kwargs go to `LLMEngine.add_request` (prefill_only,
        kv_sink). Leaving the loop early aborts the request."""

        def add() -> None:
            self.engine.add_request(request_id, prompt_token_ids, params, **kwargs)

        return self._stream(request_id, add)

    def generate_prefilled(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
        block_ids: Sequence[int],
        before_add: Callable[[], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Decode side: stream tokens 1.. of a request whose KV is in reserved blocks (see
        LLMEngine.add_prefilled_request). `before_add` runs in the same engine command, right
        before the request joins the batch (e.g. to write the received KV into the blocks)."""

        def add() -> RequestOutput | None:
            if before_add is not None:
                before_add()
            return self.engine.add_prefilled_request(
                request_id, prompt_token_ids, first_token, params, block_ids
            )

        return self._stream(request_id, add)

    async def abort(self, request_id: str) -> bool:
        return await self.call(lambda: self._abort(request_id))

    async def shutdown(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)

    async def _stream(
        self, request_id: str, add: Callable[[], RequestOutput | None]
    ) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def register_and_add() -> None:
            if request_id in self._streams:
                from pdserve.errors import InvalidRequestError

                raise InvalidRequestError("request_id", f"{request_id!r} is already streaming")
            self._streams[request_id] = (loop, queue)
            try:
                first = add()
            except BaseException:
                del self._streams[request_id]
                raise
            if first is not None:
                self._emit(first)

        await self.call(register_and_add)
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished and not self._stopped:
                await self.abort(request_id)

    # ---- engine thread ----------------------------------------------------------------
    def _emit(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        loop, queue = stream
        loop.call_soon_threadsafe(queue.put_nowait, out)

    def _abort(self, request_id: str) -> bool:
        live = self.engine.abort_request(request_id)
        if request_id in self._streams:
            self._emit(RequestOutput(request_id, [], True, "abort"))
        return live

    def _fail_all(self, exc: BaseException) -> None:
        for rid, (loop, queue) in list(self._streams.items()):
            self.engine.abort_request(rid)
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        self._streams.clear()

    def _run(self) -> None:
        while True:
            with self._cond:
                while (
                    not self._commands
                    and not self._stopped
                    and not self.engine.has_unfinished_requests()
                ):
                    self._cond.wait()
                if self._stopped:
                    break
                commands = list(self._commands)
                self._commands.clear()
            for fn, loop, fut in commands:
                try:
                    result, exc = fn(), None
                except BaseException as e:
                    result, exc = None, e
                loop.call_soon_threadsafe(_resolve, fut, result, exc)
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a failed step fails every live stream, not the thread
                    self._fail_all(e)
                    continue
                for out in outputs:
                    self._emit(out)
        # shutting down: fail pending commands and streams
        err = UnavailableError("engine is shut down")
        with self._cond:
            pending = list(self._commands)
            self._commands.clear()
        for _fn, loop, fut in pending:
            loop.call_soon_threadsafe(_resolve, fut, None, err)
        self._fail_all(err)
