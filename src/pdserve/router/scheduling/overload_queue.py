"""The ordering half of the router's admission stage (admission.py): at most `limit()`
requests run at once; the rest wait here and are let in as running ones finish. Bounds
(queue length, timeout) and metrics are the admission stage's.

Order: `sjf` lets in the waiter with the smallest predicted length first, aged
by its wait (score = predicted tokens - aging_tokens_per_s x waited seconds);
a waiter is overdue, and goes before all others (oldest first), once it waited
`max_wait_s`, or once `max_bypass` x its FCFS turn admissions happened since it
arrived (its FCFS turn = the waiters ahead of it then, plus one): under a
steady service rate, no request is let in later than max_bypass x its FCFS wait.
`fcfs` lets them in by arrival. Pure asyncio, no I/O; the clock is injected."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

ORDERS = ("fcfs", "sjf")
# A waiter this old goes before all others. Below the admission timeout (30 s by default),
# so that it matters: an aged waiter is let in before it would time out.
DEFAULT_MAX_WAIT_S = 20.0


@dataclass
class _Waiter:
    seq: int
    predicted: float
    since: float
    future: asyncio.Future = field(repr=False)
    fcfs_turn: int = 1  # admissions FCFS would need before it (waiters ahead + 1)
    admitted_before: int = 0  # admitted_total when it arrived


class OverloadQueue:
    def __init__(
        self,
        limit: Callable[[], int],
        order: Literal["fcfs", "sjf"] = "sjf",
        aging_tokens_per_s: float = 64.0,
        max_wait_s: float = DEFAULT_MAX_WAIT_S,
        max_bypass: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"unknown queue order {order!r}; choose one of {ORDERS}")
        self.limit = limit
        self.order = order
        self.aging_tokens_per_s = aging_tokens_per_s
        self.max_wait_s = max_wait_s
        self.max_bypass = max_bypass
        self._clock = clock
        self._seq = itertools.count()
        self._waiters: list[_Waiter] = []
        self.running = 0
        self.admitted_total = 0

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def has_room(self) -> bool:
        """Whether one more request may run now."""
        return self._open()

    def _open(self) -> bool:
        n = self.limit()
        return n <= 0 or self.running < n

    def score(self, w: _Waiter, now: float) -> tuple[float, ...]:
        waited = now - w.since
        bypassed = self.admitted_total - w.admitted_before
        if waited >= self.max_wait_s or (
            # the next admission would be its (bypassed + 1)-th since it arrived
            self.max_bypass > 0 and bypassed + 1 >= self.max_bypass * w.fcfs_turn
        ):
            return (0.0, w.since, w.seq)  # overdue: before everyone else, oldest first
        if self.order == "fcfs":
            return (1.0, w.seq)
        return (1.0, w.predicted - self.aging_tokens_per_s * waited, w.seq)

    def _next(self) -> _Waiter:
        now = self._clock()
        return min(self._waiters, key=lambda w: self.score(w, now))

    def dispatch(self) -> int:
        """Let waiters in while there is room; returns how many. Also call it when the
        limit grew (an instance joined)."""
        n = 0
        while self._waiters and self._open():
            w = self._next()
            self._waiters.remove(w)
            if w.future.done():  # cancelled
                continue
            self.running += 1
            self.admitted_total += 1
            w.future.set_result(None)
            n += 1
        return n

    async def acquire(self, predicted_tokens: float) -> float:
        """Wait for a slot; returns the seconds waited. Pair with `release()`."""
        t0 = self._clock()
        if not self._waiters and self._open():
            self.running += 1
            self.admitted_total += 1
            return 0.0
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(
            _Waiter(
                next(self._seq),
                float(predicted_tokens),
                t0,
                fut,
                fcfs_turn=len(self._waiters) + 1,
                admitted_before=self.admitted_total,
            )
        )
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # admitted as we were cancelled
                self.release()
            else:
                self._waiters = [w for w in self._waiters if w.future is not fut]
            raise
        return self._clock() - t0

    def release(self) -> None:
        self.running = max(0, self.running - 1)
        self.dispatch()
