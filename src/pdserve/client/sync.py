"""Client: the synchronous SDK. It owns an AsyncClient running on a private
event loop in a daemon thread; every method submits a coroutine to that loop."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

from .aio import DEFAULT_ADDR, AsyncClient
from .results import ClusterStatus, GenerationEvent, GenerationResult, collect

T = TypeVar("T")


class Client:
    def __init__(
        self,
        addr: str = DEFAULT_ADDR,
        *,
        timeout: float | None = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.1,
        api_key: str | None = None,
    ) -> None:
        self.addr = addr
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
            )

        self._aclient = self._run(make())
        self._closed = False

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the client's loop and wait. Interrupted (Ctrl-C), it cancels the
        coroutine and waits until it stopped (so e.g. a stream's call is cancelled and the
        stream can be closed) before re-raising."""
        box: list[asyncio.Task] = []

        async def guarded() -> T:
            box.append(asyncio.current_task())  # type: ignore[arg-type]
            return await coro

        fut = asyncio.run_coroutine_threadsafe(guarded(), self._loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            if box:
                task = box[0]
                self._loop.call_soon_threadsafe(task.cancel)

                async def settled() -> None:
                    await asyncio.wait({task})

                asyncio.run_coroutine_threadsafe(settled(), self._loop).result(timeout=10)
            else:
                fut.cancel()
            raise

    def generate_stream(
        self, *, timeout: float | None = None, **kwargs: Any
    ) -> Iterator[GenerationEvent]:
        agen = self._aclient.generate_stream(timeout=timeout, **kwargs)
        try:
            while True:
                try:
                    yield self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
        finally:  # also when the caller stops early: cancels the call
            self._run(agen.aclose())

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
