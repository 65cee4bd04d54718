"""The router's one admission stage: every wait a request can make before it runs, and the
capacity waits while it runs, in one place with one settings group and one metric set.

A request passes it **once** (the front door holds its `Pass` for the whole request; a
migrated stream keeps it and never queues again):

1. `Admission.admit(key)` (async context manager), per key: at most `key.max_concurrent`
   streams (running or waiting), at most `key.tokens_per_minute` tokens (prompt +
   completion) over the last 60 s; over a limit -> OverloadedError at once (429 /
   RESOURCE_EXHAUSTED) with a retry hint. `Pass.charge(n)` books tokens as they are spent.
2. `Pass.turn(predicted_tokens)`, router-wide: at most `limit()` requests run at once, the
   smaller of `max_running` and `max_running_per_decode` x serving instances (0 = no
   limit); the rest wait in an `OverloadQueue` (FCFS, or SJF by predicted length with
   aging), at most `max_queue` of them and each at most `timeout_s`; a full queue or a
   timeout -> OverloadedError. Released when the request ends.
3. `Capacity.wait(deadline, ready)`: a running request waiting for room on the workers
   (every decode full, or no instance to continue a migrated stream on) sleeps until the
   registry changes (register, heartbeat, an instance left, a request left an instance),
   not on a polling timer; `recheck_s` is only a safety net for a change the router
   cannot see (a worker frees its blocks a moment after the router saw the finish).

Metrics per key are labelled with the key's name, never its secret. No gRPC, no protos.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pdserve.errors import OverloadedError
from pdserve.rpc.metrics import Metrics

from .overload_queue import DEFAULT_MAX_WAIT_S, OverloadQueue

WINDOW_S = 60.0
QUEUE_RETRY_S = 1.0
_WAIT_BUCKETS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class SharedLimits(Protocol):
    """The per-key limits' shared half when several router replicas run (implemented over
    the shared store by router/replicas/key_limits.py)."""

    async def acquire(self, key: str, limit: int, running_here: int) -> str | None:
        """A lease for one more stream of `key` ("" when decided locally), or None when
        the key runs `limit` streams across the replicas."""
        ...

    def release(self, key: str, lease: str | None) -> None: ...

    def track_usage(self, key: str, used: Callable[[], int]) -> None: ...

    def others_used(self, key: str) -> int:
        """Tokens the other replicas booked for `key` in the last minute."""
        ...


class KeyLimits(Protocol):
    """What admission reads of an API key (frontdoor.auth.ApiKey)."""

    name: str
    max_concurrent: int
    tokens_per_minute: int


@dataclass(frozen=True)
class AdmissionConfig:
    """The router-wide half of admission (RouterSettings.admission builds it)."""

    max_running: int = 0  # requests running at once; 0 = no absolute limit
    max_running_per_decode: int = 0  # x serving decode (or colocated) instances; 0 = none
    max_queue: int = 256  # requests waiting for a turn before queue_full
    timeout_s: float = 30.0  # longest wait for a turn before queue_timeout
    order: Literal["fcfs", "sjf"] = "sjf"
    aging_tokens_per_s: float = 64.0
    max_wait_s: float = DEFAULT_MAX_WAIT_S
    max_bypass: float = 2.0
    recheck_s: float = 0.25  # capacity waits: re-check this often even without a signal


@dataclass
class _KeyState:
    running: int = 0  # streams admitted for this key, waiting for a turn or running
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


class AdmissionMetrics:
    """The stage's one metric set (declared here only)."""

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
        self.waiting = metrics.gauge(
            "router_queue_waiting", "requests waiting in the admission queue for a turn"
        )
        self.running = metrics.gauge(
            "router_queue_running", "requests holding an admission turn (running)"
        )
        self.wait = metrics.histogram(
            "router_queue_wait_seconds",
            "time spent in the admission queue (admitted requests)",
            buckets=_WAIT_BUCKETS,
        )


class Capacity:
    """Wakes requests waiting for room on the workers when the cluster changes."""

    def __init__(self, recheck_s: float = 0.25) -> None:
        self.recheck_s = recheck_s
        self._event: asyncio.Event | None = None

    def changed(self, *_: object) -> None:
        """Call on any change that may free room (registry listener; any arguments)."""
        if self._event is not None:
            self._event.set()
            self._event = None

    async def wait(self, deadline: float, ready: Callable[[], bool] | None = None) -> bool:
        """Wait for the next change (or until `ready()` holds, when given); False once
        `deadline` (time.monotonic) passed without it."""
        while True:
            if ready is not None and ready():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._event is None:
                self._event = asyncio.Event()
            try:
                await asyncio.wait_for(self._event.wait(), min(left, self.recheck_s))
                if ready is None:
                    return True
            except TimeoutError:
                if ready is None:
                    return time.monotonic() < deadline


class Pass:
    """One admitted request: `turn()` once before it runs, `charge()` as it spends."""

    def __init__(self, admission: Admission, key: KeyLimits, state: _KeyState) -> None:
        self._adm, self.key, self._state = admission, key, state
        self.turned = False  # holds a running slot of the queue
        self.waited_s = 0.0

    def charge(self, tokens: int) -> None:
        if tokens <= 0:
            return
        self._state.spent.append((time.monotonic(), tokens))
        self._state.total += tokens
        self._adm.metrics.tokens.labels(self.key.name).inc(tokens)

    async def turn(self, predicted_tokens: float) -> None:
        """Wait for a running slot (ordered by `predicted_tokens` under sjf)."""
        if self.turned:
            raise RuntimeError("a request takes its admission turn once")
        self.waited_s = await self._adm._turn(self.key, predicted_tokens)
        self.turned = True


class Admission:
    def __init__(
        self,
        metrics: Metrics,
        config: AdmissionConfig | None = None,
        serving: Callable[[], int] = lambda: 1,
        clock: Callable[[], float] = time.monotonic,  # the queue's (a simulator's virtual one)
        shared: SharedLimits | None = None,  # router replicas: limits across all of them
    ) -> None:
        self.config = c = config or AdmissionConfig()
        self.shared = shared
        self.metrics = AdmissionMetrics(metrics)
        self._serving = serving  # decode (or colocated) instances serving now
        self.queue = OverloadQueue(
            self.limit,
            order=c.order,
            aging_tokens_per_s=c.aging_tokens_per_s,
            max_wait_s=c.max_wait_s,
            max_bypass=c.max_bypass,
            clock=clock,
        )
        self.capacity = Capacity(c.recheck_s)
        self._keys: dict[str, _KeyState] = {}

    # -- router-wide limit
    def limit(self) -> int:
        """Requests allowed to run at once now (0 = unlimited)."""
        c = self.config
        limits = [c.max_running] if c.max_running > 0 else []
        if c.max_running_per_decode > 0:
            limits.append(c.max_running_per_decode * max(1, self._serving()))
        return min(limits) if limits else 0

    @property
    def waiting(self) -> int:
        return self.queue.waiting

    def dispatch(self) -> None:
        """Let waiters in after the limit grew (an instance joined)."""
        self.queue.dispatch()
        self._gauge()

    def _gauge(self) -> None:
        self.metrics.waiting.set(self.queue.waiting)
        self.metrics.running.set(self.queue.running)

    # -- per key
    def state(self, key: KeyLimits) -> _KeyState:
        return self._keys.setdefault(key.name, _KeyState())

    def _reject(self, key: KeyLimits, reason: str, message: str, after: float) -> OverloadedError:
        self.metrics.rejected.labels(key.name, reason).inc()
        return OverloadedError(message, retry_after_s=after)

    def check_key(self, key: KeyLimits) -> _KeyState:
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
            others = 0
            if self.shared is not None:
                self.shared.track_usage(key.name, lambda: st.used(time.monotonic()))
                others = self.shared.others_used(key.name)
            if st.used(now) + others >= key.tokens_per_minute:
                raise self._reject(
                    key,
                    "tokens_per_minute",
                    f"API key {key.name!r} used its {key.tokens_per_minute} tokens per minute",
                    st.free_in(now, key.tokens_per_minute),
                )
        return st

    @contextlib.asynccontextmanager
    async def admit(self, key: KeyLimits) -> AsyncIterator[Pass]:
        st = self.check_key(key)
        st.running += 1  # counted while it waits too: a key cannot flood the queue
        lease = await self._shared_lease(key, st)
        p = Pass(self, key, st)
        self.metrics.admitted.labels(key.name).inc()
        self.metrics.streams.labels(key.name).inc()
        try:
            yield p
        finally:
            self.metrics.streams.labels(key.name).dec()
            st.running -= 1
            if self.shared is not None:
                self.shared.release(key.name, lease)
            if p.turned:
                self.queue.release()
                self._gauge()

    async def _shared_lease(self, key: KeyLimits, st: _KeyState) -> str | None:
        """With router replicas: one of the key's `max_concurrent` slots across all of
        them (`st.running` already counts this request here)."""
        if self.shared is None or not key.max_concurrent:
            return None
        try:
            lease = await self.shared.acquire(key.name, key.max_concurrent, st.running - 1)
        except BaseException:
            st.running -= 1
            raise
        if lease is None:
            st.running -= 1
            raise self._reject(
                key,
                "concurrency",
                f"API key {key.name!r} already runs {key.max_concurrent} streams across the "
                f"router replicas, its limit (max_concurrent); retry when one finishes",
                QUEUE_RETRY_S,
            )
        return lease

    async def _turn(self, key: KeyLimits, predicted_tokens: float) -> float:
        c = self.config
        would_wait = self.queue.waiting > 0 or not self.queue.has_room()
        if would_wait and self.queue.waiting >= c.max_queue:
            raise self._reject(
                key,
                "queue_full",
                f"router busy: {self.queue.running} requests running and "
                f"{self.queue.waiting} waiting (max_queue={c.max_queue})",
                QUEUE_RETRY_S,
            )
        if would_wait:
            self.metrics.waiting.set(self.queue.waiting + 1)
        try:
            # (a timeout or a cancel while waiting leaves the queue clean: acquire() drops
            # the waiter, or releases the slot it was given at that moment)
            async with asyncio.timeout(c.timeout_s):
                waited = await self.queue.acquire(predicted_tokens)
        except TimeoutError:
            raise self._reject(
                key,
                "queue_timeout",
                f"router busy: no turn within {c.timeout_s:g} s",
                QUEUE_RETRY_S,
            ) from None
        finally:
            self._gauge()
        self.metrics.wait.observe(waited)
        return waited
