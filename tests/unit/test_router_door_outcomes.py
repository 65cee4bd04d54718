"""Every request the front door takes ends in exactly one way, counted and logged with its
request_id: finished, failed at any stage (before or after any work), or left by its
client. A failure is never silent (no metric, no line), whatever stage it comes from."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
from prometheus_client import CollectorRegistry

from pdserve.errors import OverloadedError, UnavailableError
from pdserve.logging import configure_logging
from pdserve.router.cluster.registry import Registry
from pdserve.router.frontdoor.auth import ANONYMOUS, ApiKey, ApiKeys
from pdserve.router.frontdoor.door import FrontDoor
from pdserve.router.frontdoor.model_info import ModelInfo
from pdserve.router.job import Chunk, Deadlines
from pdserve.router.lifecycle.orchestrator import Orchestrator
from pdserve.router.metrics import RouterMetrics, Totals
from pdserve.router.scheduling.admission import Admission
from pdserve.rpc.metrics import Metrics
from pdserve.v1 import common_pb2, router_pb2


@pytest.fixture
def log_lines(restore_logging: None) -> io.StringIO:
    buf = io.StringIO()
    configure_logging("json", "debug", service="router", stream=buf)
    return buf


def _events(buf: io.StringIO) -> list[dict]:
    lines = [json.loads(x) for x in buf.getvalue().splitlines() if x.strip()]
    return [x for x in lines if x.get("logger") == "pdserve.router"]


def _door(attempt=None) -> tuple[FrontDoor, Metrics]:
    metrics = Metrics(CollectorRegistry())
    registry = Registry()
    orch = Orchestrator(registry, None, None, Deadlines())
    if attempt is not None:
        orch._attempt = attempt  # type: ignore[method-assign]
    door = FrontDoor(
        orch, registry, ModelInfo(), RouterMetrics(metrics), Totals(),
        ApiKeys.load([], None), Admission(metrics),
    )  # fmt: skip
    return door, metrics


def _request(rid: str) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(request_id=rid)
    req.token_ids.ids.extend([5, 6, 7])
    req.sampling.max_tokens = 4
    return req


async def _run(door: FrontDoor, rid: str, key: ApiKey = ANONYMOUS) -> list[int]:
    got: list[int] = []
    async for resp in door.generate(_request(rid), key):
        got.extend(resp.token_ids)
    return got


def _count(metrics: Metrics, name: str, labels: dict[str, str]) -> float:
    return metrics.value(name, labels) or 0.0


def test_a_request_failing_before_any_work_is_counted_and_logged(log_lines):
    door, metrics = _door()  # no instance at all: the placement fails at once
    with pytest.raises(UnavailableError):
        asyncio.run(_run(door, "r-none"))
    assert _count(metrics, "router_request_errors_total", {"code": "UNAVAILABLE"}) == 1
    (line,) = [e for e in _events(log_lines) if e["event"] == "request failed"]
    assert line["request_id"] == "r-none" and line["code"] == "UNAVAILABLE"
    assert "no decode" in line["error"] and line["level"] == "info"


def test_an_admission_refusal_is_counted_and_logged(log_lines):
    door, metrics = _door()
    key = ApiKey("team", max_concurrent=1)
    door.admission.state(key).running = 1  # its one stream is taken
    with pytest.raises(OverloadedError):
        asyncio.run(_run(door, "r-429", key))
    assert _count(metrics, "router_request_errors_total", {"code": "RESOURCE_EXHAUSTED"}) == 1
    (line,) = [e for e in _events(log_lines) if e["event"] == "request failed"]
    assert line["request_id"] == "r-429" and line["key"] == "team"


def test_finished_failed_mid_stream_and_cancelled_each_end_once(log_lines):
    async def attempt(job, pred):
        for i in range(4):
            if job.request_id.startswith("r-break") and i == 2:
                raise UnavailableError("decode instance d1: connection reset")
            if job.request_id.startswith("r-slow"):
                await asyncio.sleep(10)
            yield Chunk([100 + i], common_pb2.FINISH_REASON_LENGTH if i == 3 else 0)

    door, metrics = _door(attempt)

    async def scenario() -> list[int]:
        ok = await _run(door, "r-ok")
        with pytest.raises(UnavailableError):
            await _run(door, "r-break")
        task = asyncio.ensure_future(_run(door, "r-slow"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return ok

    assert asyncio.run(scenario()) == [100, 101, 102, 103]
    ends = [(e["event"], e["request_id"]) for e in _events(log_lines)]
    assert ends == [
        ("request finished", "r-ok"),
        ("request failed", "r-break"),
        ("request cancelled by the client", "r-slow"),
    ]
    assert _count(metrics, "router_requests_total", {"finish_reason": "length"}) == 1
    assert _count(metrics, "router_request_errors_total", {"code": "UNAVAILABLE"}) == 1
    assert _count(metrics, "router_requests_total", {"finish_reason": "abort"}) == 1
    failed = next(e for e in _events(log_lines) if e["event"] == "request failed")
    assert failed["completion_tokens"] == 2 and failed["prompt_tokens"] == 3


def test_a_door_that_stops_reading_at_the_finish_has_a_finished_request(log_lines):
    """The HTTP door stops reading at the response that carries the finish and closes the
    stream there: that request finished (it is not a client's cancel)."""

    async def attempt(job, pred):
        yield Chunk([7], common_pb2.FINISH_REASON_LENGTH)

    door, metrics = _door(attempt)

    async def scenario() -> None:
        stream = door.generate(_request("r-http"), ANONYMOUS)
        resp = await anext(stream)
        assert resp.finish_reason
        await stream.aclose()  # as http/app.py's SSE writer does after the finish

    asyncio.run(scenario())
    assert [(e["event"], e["request_id"]) for e in _events(log_lines)] == [
        ("request finished", "r-http")
    ]
    assert _count(metrics, "router_requests_total", {"finish_reason": "length"}) == 1
    assert _count(metrics, "router_requests_total", {"finish_reason": "abort"}) == 0
    assert door.totals.running == 0
