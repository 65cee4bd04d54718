"""A minimal discrete-event loop: a heap of (time, sequence number, callback).

Why not simpy: the simulated actors are step-driven state machines (an engine plans a step,
the step ends, the next is planned), not long-lived processes that wait on resources, so
generator processes and simpy's resource primitives add nothing but per-event overhead
(a plan search runs thousands of simulations). A heap with a sequence number also gives a
total, seed-independent order for events at the same instant, which makes runs deterministic.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[[], None]) -> None:
        """Run `fn` at simulated time `t` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn))

    def after(self, delay_s: float, fn: Callable[[], None]) -> None:
        self.at(self.now + max(0.0, delay_s), fn)

    def clock(self) -> float:
        return self.now

    def run(self, until: float | None = None, stop: Callable[[], bool] | None = None) -> None:
        while self._heap:
            t, _, fn = self._heap[0]
            if until is not None and t > until:
                break
            heapq.heappop(self._heap)
            self.now = t
            self.events += 1
            fn()
            if stop is not None and stop():
                break
