"""Client: the synchronous SDK. It owns an AsyncClient running on a private
event loop in a daemon thread; every method submits a coroutine to that loop.

Ctrl-C (KeyboardInterrupt) can land at any bytecode of the calling thread, so the hand-off
to the loop is built to survive it anywhere:
- a coroutine is started and cancelled only through `call_soon_threadsafe`, which the loop
  runs in order: a cancel issued at any point after the start was issued (even one
  interrupted half-way) is never lost, and a cancel that overtakes the start means the
  coroutine never runs;
- a stream is iterated by ONE task on the loop, which hands events over through a queue, so
  cancelling it never races a second `__anext__`/`aclose` on the same async generator
  ("asynchronous generator is already running");
- the calling thread never blocks in C for more than `_SLICE_S`: a SIGINT whose handler
  could not run because the thread was about to block (no EINTR) is acted on within a slice.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import Any, Generic, TypeVar

from .aio import DEFAULT_ADDR, AsyncClient
from .results import ClusterStatus, GenerationEvent, GenerationResult, collect
from .routers import parse_addrs

T = TypeVar("T")

_SLICE_S = 0.1  # longest single blocking wait of the calling thread
_SETTLE_S = 10.0  # how long a cancelled call may take to stop


class _Call(Generic[T]):
    """One awaitable run as a task on `loop`, started and cancelled from another thread.
    `make` builds the awaitable on the loop thread, when (and only if) it starts: a call
    cancelled before it started leaves no coroutine behind."""

    def __init__(self, loop: asyncio.AbstractEventLoop, make: Callable[[], Awaitable[T]]) -> None:
        self._loop = loop
        self._make = make
        self._task: asyncio.Task[T] | None = None
        self._cancel_requested = False  # loop thread only
        self.started = False  # set on the loop thread: the awaitable was built and scheduled
        self._done = threading.Event()
        self._outcome: tuple[bool, Any] = (False, concurrent.futures.CancelledError())

    def start(self) -> None:
        self._loop.call_soon_threadsafe(self._start)

    def cancel(self) -> None:
        """Idempotent; safe from any thread, before or after start()."""
        self._loop.call_soon_threadsafe(self._cancel)

    def wait(self, timeout: float | None = None) -> bool:
        """True once the task finished (or will never run)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.wait(_SLICE_S):
            if deadline is not None and time.monotonic() >= deadline:
                return False
        return True

    def result(self) -> T:
        self.wait()
        ok, value = self._outcome
        if ok:
            return value
        raise value

    # loop thread
    def _start(self) -> None:
        if self._cancel_requested:  # the cancel overtook the start: never run it
            self._done.set()
            return
        self.started = True
        # the awaitable itself (no wrapper coroutine): a task cancelled before its first step
        # throws into it, so it never counts as "never awaited"
        self._task = asyncio.ensure_future(self._make(), loop=self._loop)
        self._task.add_done_callback(self._finished)

    def _cancel(self) -> None:
        self._cancel_requested = True
        if self._task is not None:
            self._task.cancel()
        else:  # not started, and it never will be
            self._done.set()

    def _finished(self, task: asyncio.Task[T]) -> None:
        if task.cancelled():
            self._outcome = (False, concurrent.futures.CancelledError())
        elif (exc := task.exception()) is not None:
            self._outcome = (False, exc)
        else:
            self._outcome = (True, task.result())
        self._done.set()


_END = object()


class _Raised:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


async def _pump(agen: AsyncGenerator[GenerationEvent, None], q: queue.SimpleQueue) -> None:
    """The only code that iterates `agen`: every event, then _END or the error, into `q`."""
    try:
        async for ev in agen:
            q.put(ev)
    except asyncio.CancelledError:
        raise  # the consumer left; it reads nothing more
    except BaseException as exc:  # handed to the consumer, who raises it
        q.put(_Raised(exc))
    else:
        q.put(_END)
    finally:
        await agen.aclose()  # a no-op when finished; closes the call when left early


class Client:
    """The synchronous twin of AsyncClient (same arguments: one router address or several,
    "a:1,b:2" or a list; a stream whose router dies is resumed on another one)."""

    def __init__(
        self,
        addr: str | Sequence[str] = DEFAULT_ADDR,
        *,
        timeout: float | None = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.1,
        api_key: str | None = None,
        resume_timeout_s: float = 30.0,
    ) -> None:
        self.addr = ",".join(parse_addrs(addr))  # (a bad address list fails here, at once)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="pdserve-client", daemon=True
        )
        self._thread.start()

        async def make() -> AsyncClient:  # the channel must be created on its loop
            return AsyncClient(
                addr,
                timeout=timeout,
                max_retries=max_retries,
                retry_backoff_s=retry_backoff_s,
                api_key=api_key,
                resume_timeout_s=resume_timeout_s,
            )

        self._aclient = self._run(make())
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the client's loop and wait. Interrupted (Ctrl-C), it cancels the
        coroutine and waits until it stopped before re-raising."""
        call: _Call[T] | None = None
        try:
            call = _Call(self._loop, lambda: coro)
            call.start()
            return call.result()
        except BaseException:
            if call is not None:
                call.cancel()
                call.wait(_SETTLE_S)
            if call is None or not call.started:
                coro.close()  # never ran: no "coroutine was never awaited"
            raise

    def generate_stream(
        self, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[GenerationEvent]:
        """Events as they arrive. Leaving early (break, close(), an exception or Ctrl-C in
        the caller's loop) cancels the call on the router before this generator closes."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        call: _Call[None] | None = None
        try:
            call = _Call(
                self._loop,
                lambda: _pump(self._aclient.generate_stream(timeout=timeout, **kwargs), q),
            )
            call.start()
            while True:
                try:
                    item = q.get(timeout=_SLICE_S)
                except queue.Empty:
                    continue
                if item is _END:
                    return
                if isinstance(item, _Raised):
                    raise item.exc
                yield item
        finally:
            if call is not None:
                call.cancel()  # a no-op when the stream ended
                call.wait(_SETTLE_S)

    def generate(self, *, timeout: float | None = None, **kwargs: Any) -> GenerationResult:
        start = time.perf_counter()
        events = list(self.generate_stream(timeout=timeout, **kwargs))
        return collect(events, start)

    def status(self, *, timeout: float | None = 10.0) -> ClusterStatus:
        return self._run(self._aclient.status(timeout=timeout))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._run(self._aclient.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
