"""The two loads of `pdserve bench router-saturation`, each measured over a window that
starts after the ramp, with the routers' CPU read at the window's two ends.

- short requests: C closed-loop clients of 8-token prompts and 1 output token; the window
  counts completed requests;
- streams: C concurrent long streams (8-token prompts, `n` tokens each, ignore_eos); the
  window counts the tokens the clients receive and the messages they came in.

`cpu` maps a name to a function returning that process's CPU seconds so far; the window's
result has each name's CPU seconds over the window (`cpu_s`), so one window serves every
router alive at the time: the one under load and the idle ones.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TICKS = 100.0  # os.sysconf("SC_CLK_TCK") on Linux


def process_cpu_s(pid: int) -> float:
    """utime + stime of every thread of `pid`, seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


@dataclass
class Window:
    """[start, end) in time.monotonic(), planned; `track` moves both to when the CPUs were
    actually read (a busy load generator reads late), and the load counts its units by the
    same clock, so units and CPU seconds cover the same interval. `cpu_s[name]` is filled
    at its end."""

    start: float
    end: float
    cpu: dict[str, Callable[[], float]]
    cpu_s: dict[str, float] = field(default_factory=dict)
    _at_start: dict[str, float] = field(default_factory=dict)
    closed: bool = False

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def counts(self, now: float) -> bool:
        """Whether a unit that arrived at `now` falls in the window."""
        return self.start <= now and not self.closed

    async def track(self) -> None:
        """Read the CPUs at the window's start and end (run as a task)."""
        length = self.end - self.start
        await asyncio.sleep(max(0.0, self.start - time.monotonic()))
        self._at_start = {k: f() for k, f in self.cpu.items()}
        self.start = time.monotonic()
        await asyncio.sleep(max(0.0, self.start + length - time.monotonic()))
        self.cpu_s = {k: f() - self._at_start[k] for k, f in self.cpu.items()}
        self.end = time.monotonic()
        self.closed = True


def _window(duration: float, ramp: float, cpu: dict[str, Callable[[], float]]) -> Window:
    now = time.monotonic()
    return Window(now + ramp * duration, now + duration, cpu)


async def short_requests(
    addr: str, concurrency: int, duration: float, cpu: dict[str, Callable[[], float]],
    ramp: float = 0.3,
) -> dict[str, Any]:  # fmt: skip
    from pdserve.client import AsyncClient

    done = errors = 0
    win = _window(duration, ramp, cpu)

    async def loop(k: int) -> None:
        nonlocal done, errors
        rng = random.Random(k)
        while not win.closed:
            try:
                await client.generate(token_ids=[rng.randrange(100_000) for _ in range(8)],
                                      max_tokens=1, ignore_eos=True)  # fmt: skip
                if win.counts(time.monotonic()):
                    done += 1
            except Exception:
                errors += 1

    async with AsyncClient(addr, timeout=120.0) as client:
        tracker = asyncio.ensure_future(win.track())
        await asyncio.gather(*(loop(k) for k in range(concurrency)))
        await tracker
    return {"requests": done, "errors": errors, "window_s": win.seconds, "cpu_s": win.cpu_s}


async def streams(
    addr: str, concurrency: int, duration: float, n: int, cpu: dict[str, Callable[[], float]],
    ramp: float = 0.3,
) -> dict[str, Any]:  # fmt: skip
    from pdserve.client import AsyncClient

    tokens = messages = 0
    win = _window(duration, ramp, cpu)

    async def one(k: int) -> None:
        nonlocal tokens, messages
        rng = random.Random(1000 + k)
        ids = [rng.randrange(100_000) for _ in range(8)]
        async for ev in client.generate_stream(token_ids=ids, max_tokens=n, ignore_eos=True):
            if win.closed:
                break
            if win.counts(time.monotonic()):
                tokens += len(ev.token_ids)
                messages += 1

    async with AsyncClient(addr, timeout=300.0) as client:
        tracker = asyncio.ensure_future(win.track())
        tasks = [asyncio.ensure_future(one(k)) for k in range(concurrency)]
        await tracker
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return {"tokens": tokens, "messages": messages, "window_s": win.seconds, "cpu_s": win.cpu_s}


async def idle(duration: float, cpu: dict[str, Callable[[], float]], ramp: float = 0.3):
    """No load: the window's CPU of every process in `cpu` (the idle routers)."""
    win = _window(duration, ramp, cpu)
    await win.track()
    return {"window_s": win.seconds, "cpu_s": win.cpu_s}
