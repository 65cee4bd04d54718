"""Streams through router replicas while one router is killed, and the checks around it
(every router serving, the flip leader): shared by test_router_replicas.py and the by-hand
stress tests/stress/router_kill.py."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Callable, Sequence


async def streams_until(
    addrs: Sequence[str],
    requests: Sequence[dict],
    on_progress: Callable[[list[int]], bool],
    key: str = "sk-beta",
) -> list:
    """Run the streams through one SDK client over `addrs`; `on_progress(counts)` (tokens
    each stream has so far; called in a thread) is polled until it returns True. Returns per
    stream (tokens, finish reason, text), or the exception it raised."""
    from pdserve.client import AsyncClient

    counts = [0] * len(requests)

    async def one(client, i: int, req: dict):
        tokens: list[int] = []
        text, finish = [], None
        async for ev in client.generate_stream(**req):
            tokens += ev.token_ids
            text.append(ev.text)
            counts[i] = len(tokens)
            finish = ev.finish_reason or finish
        return tokens, finish, "".join(text)

    async with AsyncClient(list(addrs), timeout=180.0, api_key=key) as client:
        tasks = [asyncio.ensure_future(one(client, i, r)) for i, r in enumerate(requests)]
        try:
            deadline = time.monotonic() + 90
            while not await asyncio.to_thread(on_progress, list(counts)):
                assert time.monotonic() < deadline, "the streams never reached the kill point"
                assert not all(t.done() for t in tasks), "every stream ended before the kill"
                await asyncio.sleep(0.02)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 180)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class RouterKiller:
    """An `on_progress` for `streams_until`: once every stream has `min_tokens` tokens,
    SIGKILL the router `choose(running)` names (running: router name -> streams it relays),
    and remember who it was and what each stream had received then."""

    def __init__(
        self,
        cluster,
        status: Callable[[str], object],
        min_tokens: int = 5,
        choose: Callable[[dict[str, int]], str | None] | None = None,
    ) -> None:
        self.cluster = cluster
        self.status = status  # addr -> router Status (requests_running)
        self.min_tokens = min_tokens
        self.choose = choose or busiest
        self.victim: str | None = None
        self.at_kill: list[int] = []

    def __call__(self, counts: list[int]) -> bool:
        if min(counts) < self.min_tokens:  # every stream has tokens: each one must resume
            return False
        running = {
            name: self.status(f"127.0.0.1:{ports[0]}").requests_running
            for name, ports in self.cluster.router_ports.items()
        }
        victim = self.choose(running)
        if victim is None:
            return False
        self.cluster.processes[victim].signal(signal.SIGKILL)
        self.victim, self.at_kill = victim, counts
        return True


def busiest(running: dict[str, int]) -> str | None:
    """The router relaying the most streams, when it relays at least two."""
    victim = max(running, key=lambda name: running[name])
    return victim if running[victim] >= 2 else None


def divergence(got: list[int], want: list[int], received_at_kill: int) -> str:
    """How a stream's tokens differ from the expected ones, in words."""
    same = min(len(got), len(want))
    first = next((i for i in range(same) if got[i] != want[i]), same)
    return (
        f"{len(got)} tokens (want {len(want)}), first differs at {first}, "
        f"{received_at_kill} received when the router was killed"
    )


def serves_every_worker(cluster, addr: str, status: Callable[[str], object]) -> bool:
    """Whether the router at `addr` answers Status and lists every worker of `cluster`."""
    try:
        return len(status(addr).instances) == len(cluster.worker_names())
    except Exception:  # not listening, or "not serving yet"
        return False


def flip_leaders(cluster) -> list[str]:
    """The routers whose current process gained the flip leadership (its own log says so;
    a restarted router starts a fresh log)."""
    return [
        name
        for name in cluster.router_names()
        if "flip leadership gained" in cluster.processes[name].log_path.read_text()
    ]
