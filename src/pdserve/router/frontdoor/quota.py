"""Admission control of the public front doors: per-key limits and a bounded router queue.

`Quotas.admit(key)` is an async context manager around one request:
1. per key: at most `key.max_concurrent` streams at once, and at most
   `key.tokens_per_minute` tokens (prompt + completion) over the last 60 s; over a limit ->
   OverloadedError (RESOURCE_EXHAUSTED / HTTP 429) with a retry hint;
2. router-wide: at most `max_running` requests run; up to `max_queue` more wait (FIFO, at
   most `queue_timeout_s`); a full queue or a wait that times out -> OverloadedError.
`Admission.charge(n)` books tokens against the key as they are spent.
Metrics per key are labelled with the key's name, never its secret.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pdserve.errors import OverloadedError
from pdserve.rpc.metrics import Metrics

from .auth import ApiKey

WINDOW_S = 60.0
QUEUE_RETRY_S = 1.0


@dataclass
class _KeyState:
    running: int = 0
    spent: collections.deque = field(default_factory=collections.deque)  # (t, tokens)
    total: int = 0  # tokens in `spent`

    def used(self, now: float) -> int:
        while self.spent and self.spent[0][0] <= now - WINDOW_S:
            self.total -= self.spent.popleft()[1]
        return self.total

    def free_in(self, now: float, limit: int) -> float:
        """Seconds until the window's usage drops below `limit`."""
        total = self.total
        for t, n in self.spent:
            total -= n
            if total < limit:
                return max(0.0, t + WINDOW_S - now)
        return WINDOW_S


class QuotaMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.admitted = metrics.counter("router_key_requests", "requests admitted", ["key"])
        self.rejected = metrics.counter(
            "router_key_rejections",
            "requests refused by admission control",
            ["key", "reason"],  # concurrency | tokens_per_minute | queue_full | queue_timeout
        )
        self.tokens = metrics.counter(
            "router_key_tokens", "tokens booked against a key (prompt + completion)", ["key"]
        )
        self.streams = metrics.gauge("router_key_streams", "streams running per key", ["key"])
        self.waiting = metrics.gauge("router_queue_waiting", "requests waiting for a slot")


class Admission:
    """One admitted request: book its tokens with charge()."""

    def __init__(self, quotas: Quotas, key: ApiKey, state: _KeyState) -> None:
        self._quotas, self.key, self._state = quotas, key, state

    def charge(self, tokens: int) -> None:
        if tokens <= 0:
            return
        self._state.spent.append((time.monotonic(), tokens))
        self._state.total += tokens
        self._quotas.metrics.tokens.labels(self.key.name).inc(tokens)


class Quotas:
    def __init__(
        self,
        metrics: Metrics,
        *,
        max_running: int = 0,
        max_queue: int = 0,
        queue_timeout_s: float = 30.0,
    ) -> None:
        self.metrics = QuotaMetrics(metrics)
        self.max_running, self.max_queue = max_running, max_queue
        self.queue_timeout_s = queue_timeout_s
        self._slots = asyncio.Semaphore(max_running) if max_running > 0 else None
        self.waiting = 0
        self._keys: dict[str, _KeyState] = {}

    def state(self, key: ApiKey) -> _KeyState:
        return self._keys.setdefault(key.name, _KeyState())

    def _reject(self, key: ApiKey, reason: str, message: str, after: float) -> OverloadedError:
        self.metrics.rejected.labels(key.name, reason).inc()
        return OverloadedError(message, retry_after_s=after)

    def check_key(self, key: ApiKey) -> _KeyState:
        st = self.state(key)
        if key.max_concurrent and st.running >= key.max_concurrent:
            raise self._reject(
                key,
                "concurrency",
                f"API key {key.name!r} already runs {st.running} streams, its limit "
                f"(max_concurrent={key.max_concurrent}); retry when one finishes",
                QUEUE_RETRY_S,
            )
        if key.tokens_per_minute:
            now = time.monotonic()
            if st.used(now) >= key.tokens_per_minute:
                raise self._reject(
                    key,
                    "tokens_per_minute",
                    f"API key {key.name!r} used its {key.tokens_per_minute} tokens per minute",
                    st.free_in(now, key.tokens_per_minute),
                )
        return st

    @contextlib.asynccontextmanager
    async def admit(self, key: ApiKey) -> AsyncIterator[Admission]:
        st = self.check_key(key)
        st.running += 1  # counted while it waits too: a key cannot flood the queue
        try:
            async with self._slot(key):
                self.metrics.admitted.labels(key.name).inc()
                self.metrics.streams.labels(key.name).inc()
                try:
                    yield Admission(self, key, st)
                finally:
                    self.metrics.streams.labels(key.name).dec()
        finally:
            st.running -= 1

    @contextlib.asynccontextmanager
    async def _slot(self, key: ApiKey) -> AsyncIterator[None]:
        if self._slots is None:
            yield
            return
        if self._slots.locked():
            if self.waiting >= self.max_queue:
                raise self._reject(
                    key,
                    "queue_full",
                    f"router busy: {self.max_running} requests running and {self.waiting} "
                    f"waiting (max_queue={self.max_queue})",
                    QUEUE_RETRY_S,
                )
            self.waiting += 1
            self.metrics.waiting.set(self.waiting)
            try:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout_s)
            except TimeoutError:
                raise self._reject(
                    key,
                    "queue_timeout",
                    f"router busy: no slot within {self.queue_timeout_s:g} s",
                    QUEUE_RETRY_S,
                ) from None
            finally:
                self.waiting -= 1
                self.metrics.waiting.set(self.waiting)
        else:
            await self._slots.acquire()
        try:
            yield
        finally:
            self._slots.release()
