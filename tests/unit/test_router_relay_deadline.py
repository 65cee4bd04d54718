"""The relay's read deadline (first token, then idle between messages) is enforced by the
stream's watchdog, not by an asyncio.wait_for around every read (~50 us of router CPU per
token); PDSERVE_RELAY_WAIT_FOR=1 keeps the old timer as the benchmark's baseline. Both raise
the same DeadlineError on a silent stream."""

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


@pytest.mark.parametrize("wait_for", [False, True])
@pytest.mark.parametrize("sent", [0, 3])
def test_a_silent_stream_hits_its_deadline(monkeypatch, wait_for: bool, sent: int):
    monkeypatch.setattr(orch_mod, "DECODE_WATCH_S", 0.01)
    monkeypatch.setattr(orch_mod, "RELAY_WAIT_FOR", wait_for)
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
