"""Waiting for decode KV instead of failing: the back-off loop of one request's Reserve rounds."""

from __future__ import annotations

import asyncio
import time

from pdserve.errors import OverloadedError


class KvQueue:
    """While every decode is full, a request waits here (backing off) for up to
    `timeout_s`: overload becomes waiting, as in a single engine, not an error."""

    def __init__(self, timeout_s: float) -> None:
        self._deadline = time.monotonic() + timeout_s
        self._backoff = 0.01

    async def wait(self, overloaded: OverloadedError) -> None:
        """Sleep before the next round of Reserve attempts; raise `overloaded` when the
        next sleep would pass the deadline."""
        if time.monotonic() + self._backoff > self._deadline:
            raise overloaded
        await asyncio.sleep(self._backoff)  # blocks free as running requests finish
        self._backoff = min(self._backoff * 2, 0.2)
