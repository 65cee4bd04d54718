"""The router replicas a client knows: which one to use next, which failed lately."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence

from .errors import Unavailable

DOWN_S = 2.0  # a router that failed is skipped this long (while another one is up)
MAX_BACKOFF_S = 1.0


def parse_addrs(addr: str | Sequence[str]) -> list[str]:
    """ "a:1,b:2" or ["a:1", "b:2"] (entries may hold commas too) -> ["a:1", "b:2"]."""
    parts = [addr] if isinstance(addr, str) else list(addr)
    out: list[str] = []
    for part in parts:
        if not isinstance(part, str):
            raise TypeError(f"a router address is a string HOST:PORT, got {part!r}")
        out += [a.strip() for a in part.split(",") if a.strip()]
    if not out:
        raise ValueError("no router address given (HOST:PORT, or several: a:1,b:2)")
    return list(dict.fromkeys(out))  # each once, in the given order


class Routers:
    """Round robin over the addresses, skipping the ones that failed in the last `DOWN_S`
    seconds while any other is not (all down: the least recently failed one)."""

    def __init__(
        self, addr: str | Sequence[str], clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.addrs = parse_addrs(addr)
        self._clock = clock
        self._next = random.randrange(len(self.addrs))  # clients spread over the replicas
        self._down: dict[str, float] = {}  # addr -> when it last failed

    def _up(self, addr: str, now: float) -> bool:
        return now - self._down.get(addr, -DOWN_S) >= DOWN_S

    def pick(self) -> str:
        now = self._clock()
        n = len(self.addrs)
        for i in range(n):
            addr = self.addrs[(self._next + i) % n]
            if self._up(addr, now):
                self._next = (self._next + i + 1) % n
                return addr
        return min(self.addrs, key=lambda a: self._down.get(a, 0.0))

    def in_order(self) -> list[str]:
        """Every address, live ones first (for a one-shot call such as Status)."""
        now = self._clock()
        return sorted(self.addrs, key=lambda a: (not self._up(a, now), self.addrs.index(a)))

    def failed(self, addr: str) -> None:
        self._down[addr] = self._clock()

    def backoff(self, attempt: int, base_s: float) -> float:
        """No wait while another router may be up; else exponential, at most 1 s."""
        now = self._clock()
        if any(self._up(a, now) for a in self.addrs):
            return 0.0
        return min(MAX_BACKOFF_S, base_s * (2**attempt))

    def unavailable(self, last: Unavailable, failures: dict[str, str]) -> Unavailable:
        """The error when no router could serve a call: one router, its own message;
        several, every address with its last failure."""
        if len(self.addrs) == 1:
            return last
        named = "; ".join(f"{a}: {failures.get(a, 'not tried')}" for a in self.addrs)
        error = Unavailable(f"no router could serve the call ({named})", last.code)
        error.retry_after_s = last.retry_after_s
        return error
