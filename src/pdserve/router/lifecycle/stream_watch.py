"""One watchdog for every relayed worker stream of a router.

A relayed stream (`Orchestrator._relay`) must end when its instance is lost (expired, or no
heartbeat for the timeout: a hung or partitioned worker keeps its stream open and silent) or
when it stays silent past its read deadline (first token, then idle between messages). The
relay awaits `call.read()` without a timer (an `asyncio.wait_for` per message cost ~57 us of
router CPU per token); the deadline is enforced here instead, by cancelling the call.

Invariant: ONE task ticks every `interval_s()` for all watched streams, and only while at
least one is watched. A tick that comes late by more than an interval (and `STALL_S`)
judges nothing: the router itself did not run (an overloaded or descheduled process), so the
messages and heartbeats it has not read yet may be waiting in its sockets; silence it caused
itself is not the workers'. A task per stream (the previous design) woke 4 times a second per
stream: at 1,024 open streams that was ~4,000 task wake-ups a second, more than the tokens
the router relayed at saturation. A tick costs a dict walk and one registry lookup per
distinct instance.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from ..cluster.registry import Registry

STALL_S = 0.5  # a tick this late (or an interval late) means the router itself stalled


class WatchedStream:
    """One relayed stream: its call, its instance, its read deadline, and why it was cut."""

    __slots__ = ("call", "deadline", "expired", "instance_id", "lost")

    def __init__(self, call: Any, instance_id: str, limit_s: float) -> None:
        self.call = call
        self.instance_id = instance_id
        self.deadline = time.monotonic() + limit_s
        self.lost = False  # the instance was lost: the watchdog cancelled the call
        self.expired = False  # silent past its deadline: the watchdog cancelled the call

    def seen(self, limit_s: float) -> None:
        """A message arrived: the next one is due within `limit_s`."""
        self.deadline = time.monotonic() + limit_s


class StreamWatch:
    """Cancels the calls of watched streams whose instance is lost or that went silent."""

    def __init__(self, registry: Registry, interval_s: Callable[[], float]) -> None:
        self.registry = registry
        self._interval_s = interval_s  # read at every tick (tests shorten it)
        self._streams: dict[int, WatchedStream] = {}
        self._task: asyncio.Task | None = None

    def __len__(self) -> int:
        return len(self._streams)

    def watch(self, call: Any, instance_id: str, limit_s: float) -> WatchedStream:
        """Watch `call` (served by `instance_id`, first message due within `limit_s`) until
        `unwatch` (`limit_s` = inf: no deadline, the caller times its reads). Runs in the event
        loop that relays it."""
        stream = WatchedStream(call, instance_id, limit_s)
        self._streams[id(stream)] = stream
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return stream

    def unwatch(self, stream: WatchedStream) -> None:
        self._streams.pop(id(stream), None)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self._streams:
            interval = self._interval_s()
            due = loop.time() + interval
            await asyncio.sleep(interval)
            if loop.time() - due > max(interval, STALL_S):  # we did not run: judge next tick
                continue
            self.tick()
        self._task = None

    def tick(self) -> None:
        """One pass over every watched stream (see the module docstring)."""
        now = time.monotonic()
        lost: dict[str, bool] = {}
        for key, stream in list(self._streams.items()):
            gone = lost.get(stream.instance_id)
            if gone is None:
                gone = lost[stream.instance_id] = self.registry.lost(stream.instance_id)
            if gone:
                stream.lost = True
            elif now > stream.deadline:
                stream.expired = True
            else:
                continue
            del self._streams[key]  # cut once; the relay unwatches it again (a no-op)
            stream.call.cancel()
