"""EmulatedLink: the modelled time of a KV push. The wire carries a few bytes per block; a
send of w wire bytes stands for w * (modelled / wire bytes per block) modelled bytes, which
take `link.time_s(bytes) * time_scale` of wall time. Sends of one sender are serialised (one
NIC / NVLink port): each waits for the link to be free, then for its own transfer time."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from pdserve.costmodel.costs import LinkCost

T = TypeVar("T")


class EmulatedLink:
    def __init__(self, link: LinkCost, bytes_ratio: float, time_scale: float) -> None:
        self.link = link
        self.bytes_ratio = bytes_ratio  # modelled bytes per wire byte
        self.time_scale = time_scale
        self._free_at = 0.0
        self.modelled_s = 0.0  # modelled seconds charged
        self.modelled_bytes = 0.0

    def delay_s(self, wire_bytes: int) -> float:
        """Wall seconds from now until a send of `wire_bytes` has crossed the link; reserves
        the link for it."""
        nbytes = wire_bytes * self.bytes_ratio
        cost = self.link.time_s(nbytes)
        self.modelled_s += cost
        self.modelled_bytes += nbytes
        now = time.perf_counter()
        start = max(now, self._free_at)
        self._free_at = start + cost * self.time_scale
        return self._free_at - now

    async def after(self, wire_bytes: int, send: Awaitable[T]) -> T:
        """Run `send` once the modelled transfer of `wire_bytes` is over."""
        delay = self.delay_s(wire_bytes)
        try:
            if delay > 0:
                await asyncio.sleep(delay)
        except BaseException:
            close = getattr(send, "close", None)
            if close is not None:
                close()  # a coroutine never awaited: close it (no warning)
            raise
        return await send

    def counters(self) -> dict[str, Any]:
        return {"emulate_link_modelled_s": self.modelled_s,
                "emulate_link_modelled_bytes": self.modelled_bytes}  # fmt: skip
