"""Router relay cost per message with the stream watchdog (router migration work).

`Orchestrator._relay` reads a worker's token stream with `asyncio.wait_for(call.read())` per
message and one watchdog task per stream (it notices an instance that stopped heartbeating).
This compares it, in the same run, with the relay loop without a watchdog (the baseline):
`streams` concurrent fake streams of `messages` messages each (an in-memory call whose read
yields to the loop once), rounds alternating, microseconds per message.

    python -m pdserve.bench.relay_watch --messages 2000 --streams 32 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import grpc

from pdserve.router.cluster.registry import ROLE_DECODE, Registry
from pdserve.router.job import Stages
from pdserve.router.lifecycle.orchestrator import Chunk, Deadlines, Orchestrator
from pdserve.v1 import common_pb2


class _Msg:
    def __init__(self, finish: int = 0) -> None:
        self.token_ids = [7]
        self.finish_reason = finish
        self.stages = common_pb2.StageCosts()


class _FakeCall:
    def __init__(self, n: int) -> None:
        self.n = n

    async def read(self) -> _Msg:
        await asyncio.sleep(0)
        self.n -= 1
        return _Msg(1 if self.n == 0 else 0)

    def cancel(self) -> bool:
        return True


class _Placement:
    def leave(self, *_a: object, **_k: object) -> None:
        pass


class _Job:
    stages = Stages()


async def _baseline_relay(call: _FakeCall, wait: float = 60.0):
    """The relay loop without a watchdog (as before the migration work)."""
    while True:
        msg = await asyncio.wait_for(call.read(), wait)
        if msg is grpc.aio.EOF:
            raise RuntimeError("EOF")
        yield Chunk(list(msg.token_ids), msg.finish_reason)
        if msg.finish_reason:
            return


async def measure(messages: int, streams: int, rounds: int) -> dict[str, list[float]]:
    reg = Registry()
    inst = reg.register("d1", "127.0.0.1:1", ROLE_DECODE, "fp", 16)
    orch = Orchestrator(reg, None, None, Deadlines())  # type: ignore[arg-type]

    async def baseline() -> None:
        async for _ in _baseline_relay(_FakeCall(messages)):
            pass

    async def watched() -> None:
        relay = orch._relay(_FakeCall(messages), inst, _Job, _Placement(), "decode")  # type: ignore[arg-type]
        async for _ in relay:
            pass

    out: dict[str, list[float]] = {"baseline": [], "watchdog": []}
    for _ in range(rounds):
        for name, fn in (("baseline", baseline), ("watchdog", watched)):
            t0 = time.perf_counter()
            await asyncio.gather(*(fn() for _ in range(streams)))
            out[name].append((time.perf_counter() - t0) / (messages * streams) * 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--messages", type=int, default=2000)
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    a = p.parse_args(argv)
    res = asyncio.run(measure(a.messages, a.streams, a.rounds))
    for name, v in res.items():
        print(
            f"{name:9s} us/message: median {statistics.median(v):.2f}  min {min(v):.2f}  "
            f"rounds {[round(x, 1) for x in v]}"
        )
    ratio = statistics.median(res["watchdog"]) / statistics.median(res["baseline"])
    print(f"watchdog / baseline (median): {ratio:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
