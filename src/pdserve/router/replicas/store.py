"""The shared store of the router replicas: a Redis server users already run (or the one
`pdserve up`, compose and the Kubernetes manifests start). Never a single point of failure:
every call has a short timeout, and a failed call marks the store down (logged once, the
gauge `pdserve_router_shared_store_up` at 0) so that callers fall back to what is safe
without it (per-key limits: a local share; flips: none). A ping loop marks it up again."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pdserve.logging import get_logger
from pdserve.rpc.metrics import Metrics

log = get_logger("pdserve.router.replicas")
T = TypeVar("T")

CALL_TIMEOUT_S = 0.5
PING_S = 1.0


class StoreDown(Exception):
    """The shared store did not answer (or answered with an error)."""


class SharedStore:
    def __init__(self, url: str, metrics: Metrics | None = None, client: Any = None) -> None:
        self.url = url
        if client is None:
            import redis.asyncio as aioredis

            client = aioredis.Redis.from_url(
                url,
                socket_timeout=CALL_TIMEOUT_S,
                socket_connect_timeout=CALL_TIMEOUT_S,
                decode_responses=True,
            )
        self.redis = client
        self.up = False
        self.last_error = "connecting"
        self._gauge = (
            metrics.gauge("router_shared_store_up", "1 while the shared store (Redis) answers")
            if metrics is not None
            else None
        )
        self._task: asyncio.Task | None = None

    def describe(self) -> str:
        """For Status: `redis up` or `redis down: <why>`."""
        return "redis up" if self.up else f"redis down: {self.last_error}"

    def _set(self, up: bool, error: str = "") -> None:
        if up != self.up:
            if up:
                log.info("shared store up", url=_safe(self.url))
            else:
                log.warning(
                    "shared store down: per-key limits fall back to a local share, no flips",
                    url=_safe(self.url), error=error,
                )  # fmt: skip
        self.up = up
        self.last_error = error
        if self._gauge is not None:
            self._gauge.set(1 if up else 0)

    async def call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run one Redis call under the timeout; StoreDown (and the store marked down) if
        it fails."""
        try:
            async with asyncio.timeout(CALL_TIMEOUT_S * 2):
                result = await fn()
        except (TimeoutError, OSError, Exception) as exc:  # redis errors subclass Exception
            if isinstance(exc, asyncio.CancelledError):
                raise
            self._set(False, f"{type(exc).__name__}: {exc}")
            raise StoreDown(str(exc)) from exc
        if not self.up:
            self._set(True)
        return result

    async def ping_loop(self) -> None:
        while True:
            with contextlib.suppress(StoreDown):
                await self.call(self.redis.ping)
            await asyncio.sleep(PING_S)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self.ping_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self.redis.aclose()


def _safe(url: str) -> str:
    """The URL without a password (redis://:secret@host -> redis://***@host)."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"
