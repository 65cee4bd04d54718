"""The relay's read deadline (first token, then idle between messages) is enforced by the
stream's watchdog, not by an asyncio.wait_for around every read (~50 us of router CPU per
token). A silent stream raises DeadlineError, before and after its first message."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.errors import DeadlineError
from pdserve.router.cluster.registry import ROLE_DECODE, Registry
from pdserve.router.job import Deadlines, Job
from pdserve.router.lifecycle import orchestrator as orch_mod
from pdserve.router.lifecycle.orchestrator import Orchestrator
from tests.unit.test_router_migration import SilentCall


def _job() -> Job:
    return Job(request_id="r1", token_ids=[1, 2], params=SamplingParams(max_tokens=10))


@pytest.mark.parametrize("sent", [0, 3])
def test_a_silent_stream_hits_its_deadline(monkeypatch, sent: int):
    monkeypatch.setattr(orch_mod, "DECODE_WATCH_S", 0.01)
    reg = Registry(heartbeat_timeout_s=3600.0)
    inst = reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)
    orch = Orchestrator(reg, None, None, Deadlines(first_token_s=0.05, decode_idle_s=0.1))
    call = SilentCall(sent)

    async def scenario() -> list:
        got = []
        async for chunk in orch._relay(call, inst, _job(), None, "decode"):
            got.append(chunk)
        return got

    with pytest.raises(DeadlineError, match=r"decode instance d1 sent nothing for 0\.\d+ s"):
        asyncio.run(asyncio.wait_for(scenario(), 5))
    assert call.cancelled


class _Call:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


def test_one_watchdog_task_serves_every_stream_and_cuts_only_the_bad_ones():
    """1,000 watched streams share ONE task (a task per stream woke 4x/s per stream); a lost
    instance cuts its streams, a silent stream is cut at its deadline, a live one is not;
    the task ends with the last stream."""
    from pdserve.router.lifecycle.stream_watch import StreamWatch

    reg = Registry(heartbeat_timeout_s=3600.0)
    reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)
    reg.register("d2", "127.0.0.1:3", ROLE_DECODE, "fp", 16)
    watch = StreamWatch(reg, lambda: 0.01)

    async def scenario() -> None:
        before = len(asyncio.all_tasks())
        live = [watch.watch(_Call(), "d1", 10.0) for _ in range(1000)]
        silent = watch.watch(_Call(), "d1", 0.02)
        on_d2 = watch.watch(_Call(), "d2", 10.0)
        assert len(asyncio.all_tasks()) == before + 1
        reg.get("d2").last_heartbeat -= 1e6  # stopped heartbeating: lost
        await asyncio.sleep(0.1)
        assert on_d2.lost and on_d2.call.cancelled and not on_d2.expired
        assert silent.expired and silent.call.cancelled and not silent.lost
        assert not any(s.call.cancelled or s.lost or s.expired for s in live)
        assert len(watch) == 1000
        for s in live:
            watch.unwatch(s)
        await asyncio.sleep(0.05)
        assert len(asyncio.all_tasks()) == before  # the tick task ended with the last stream

    asyncio.run(scenario())


def test_a_tick_late_because_the_router_stalled_judges_nothing():
    """The router's own loop did not run for a while (overloaded, descheduled): the
    heartbeats it has not read yet wait in its sockets, so the late tick cuts nothing; the
    next one, after the heartbeats were read, finds the instance alive."""
    import time

    from pdserve.router.lifecycle.stream_watch import STALL_S, StreamWatch

    reg = Registry(heartbeat_timeout_s=0.3)
    reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)
    watch = StreamWatch(reg, lambda: 0.05)

    async def scenario():
        stream = watch.watch(_Call(), "d1", 10.0)
        await asyncio.sleep(0.1)  # (ticking: the stream is fine)
        time.sleep(STALL_S + 0.5)  # noqa: ASYNC251 (the loop stalls past the heartbeat timeout)
        asyncio.get_running_loop().call_later(0.02, reg.seen, "d1")  # what waited: read
        await asyncio.sleep(0.3)
        return stream

    stream = asyncio.run(scenario())
    assert not (stream.lost or stream.call.cancelled)
