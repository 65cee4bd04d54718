"""The one admission stage (scheduling/admission.py) with the orchestrator's migration:
per-key limits, SJF order and a migrated stream together (a continuation keeps its turn
and its prediction: it never queues again, and the predictor learns the whole length);
capacity waits wake on a registry change; one metric name, one meaning."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdserve.engine.params import SamplingParams
from pdserve.errors import OverloadedError
from pdserve.router.cluster.registry import ROLE_DECODE, ROLE_PREFILL, Registry
from pdserve.router.cluster.workers import RemoteError
from pdserve.router.frontdoor.auth import ApiKey
from pdserve.router.job import Chunk, Deadlines, Job
from pdserve.router.lifecycle.orchestrator import Orchestrator
from pdserve.router.scheduling.admission import Admission, AdmissionConfig, Capacity
from pdserve.router.scheduling.length import LengthScheduling
from pdserve.router.scheduling.predictor import EwmaPredictor, LengthEstimate
from pdserve.rpc.metrics import Metrics
from pdserve.v1 import common_pb2

LENGTH = common_pb2.FINISH_REASON_LENGTH


class Learner(EwmaPredictor):
    """Predicts the length the request carries; records what it is taught."""

    def __init__(self) -> None:
        super().__init__()
        self.learned: list[tuple[int, int]] = []

    def estimate(self, query) -> LengthEstimate:
        n = float(query.oracle_tokens)
        return LengthEstimate(n, n, "test")

    def learn(self, query, actual: int) -> None:
        self.learned.append((query.num_prompt_tokens, actual))


def _job(rid: str, max_tokens: int, oracle: int) -> Job:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Job(
        rid,
        [1, 2, 3, 4],
        params,
        oracle_tokens=oracle,
    )


async def _until(cond, what: str) -> None:
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


async def test_per_key_limits_sjf_order_and_a_migration_together():
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    adm = Admission(
        metrics,
        AdmissionConfig(max_running=1, max_queue=8, timeout_s=30, order="sjf",
                        aging_tokens_per_s=0.0, max_bypass=0.0),
    )  # fmt: skip
    reg = Registry()
    reg.register("p1", "127.0.0.1:1", ROLE_PREFILL, "fp", 16)
    reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)
    reg.register("d2", "127.0.0.1:3", ROLE_DECODE, "fp", 16)
    learner = Learner()
    # (use_max_tokens=False: the predictions are not clamped to the short max_tokens)
    length = LengthScheduling(learner, oracle=True, use_max_tokens=False)
    orch = Orchestrator(reg, None, None, Deadlines(), length=length, capacity=adm.capacity)

    gate, resumed = asyncio.Event(), asyncio.Event()
    attempts: list[str] = []

    async def chunks(job: Job):
        if job.request_id == "long":  # streams 2 tokens, then its decode dies
            await gate.wait()
            yield Chunk([11], 0)
            yield Chunk([12], 0)
            raise RemoteError(grpc.StatusCode.UNAVAILABLE, "decode: connection reset")
        if job.request_id == "long.m1":  # the continuation: 4 more tokens
            await resumed.wait()
        for i in range(job.params.max_tokens):
            last = i == job.params.max_tokens - 1
            yield Chunk([20 + i], LENGTH if last else 0)

    async def attempt(job: Job, pred):  # the orchestrator's one placement, faked
        attempts.append(job.request_id)
        job.decode_instance = f"d{len(attempts) % 2 + 1}"
        async for chunk in chunks(job):
            job.output_token_ids.extend(chunk.token_ids)  # (as Orchestrator._attempt does)
            yield chunk

    orch._attempt = attempt  # type: ignore[method-assign]
    admitted: list[str] = []
    outputs: dict[str, list[int]] = {}

    async def request(name: str, key: ApiKey, max_tokens: int, predicted: int) -> None:
        job = _job(name, max_tokens, predicted)
        async with adm.admit(key) as p:
            pred = await orch.predict(job)
            await p.turn(pred.predicted_tokens)
            admitted.append(name)
            out = outputs.setdefault(name, [])
            async for chunk in orch.run(job, pred):
                out += chunk.token_ids

    a, b = ApiKey("a", max_concurrent=2), ApiKey("b")
    long = asyncio.create_task(request("long", b, 6, 50))
    await _until(lambda: admitted == ["long"], "the first request runs")
    tasks = [
        asyncio.create_task(request("a1", a, 3, 30)),
        asyncio.create_task(request("a2", a, 3, 10)),
        asyncio.create_task(request("b1", b, 3, 20)),
    ]
    await _until(lambda: adm.waiting == 3, "three requests wait")
    with pytest.raises(OverloadedError, match="max_concurrent=2"):  # a's waiting streams count
        await request("a3", a, 3, 1)
    assert metrics.value("router_queue_waiting") == 3

    gate.set()  # the long request streams, breaks, and continues on another decode
    await _until(lambda: "long.m1" in attempts, "the stream migrates")
    assert admitted == ["long"], "nobody else got the turn the migrated stream holds"
    assert adm.waiting == 3 and adm.queue.running == 1 and adm.queue.admitted_total == 1
    resumed.set()
    await asyncio.gather(long, *tasks)

    assert admitted == ["long", "a2", "b1", "a1"]  # then shortest predicted first
    assert adm.queue.admitted_total == 4  # one turn per request, the migration included
    assert outputs["long"] == [11, 12, 20, 21, 22, 23]  # no token lost or repeated
    # learned once per request: the whole length of the migrated one, with its own prompt
    assert sorted(learner.learned) == [(4, 3), (4, 3), (4, 3), (4, 6)]
    assert metrics.value("router_queue_waiting") == 0
    assert metrics.value("router_queue_running") == 0
    assert metrics.value("router_key_rejections_total", {"key": "a", "reason": "concurrency"}) == 1
    assert adm.state(a).running == 0 and adm.state(b).running == 0


async def test_capacity_waits_wake_on_a_registry_change_not_a_timer():
    reg = Registry()
    capacity = Capacity(recheck_s=30.0)  # the safety net is far away: only the event wakes
    reg.on_change(capacity.changed)
    t0 = time.monotonic()
    waiter = asyncio.create_task(
        capacity.wait(t0 + 20.0, ready=lambda: bool(reg.candidates(ROLE_DECODE)))
    )
    await asyncio.sleep(0.01)
    assert not waiter.done()
    reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)
    assert await asyncio.wait_for(waiter, 5.0) is True
    assert time.monotonic() - t0 < 5.0
    # a deadline that passes without a change: False
    assert (
        await Capacity(recheck_s=0.01).wait(time.monotonic() + 0.03, ready=lambda: False) is False
    )


def test_a_metric_name_has_one_meaning():
    """Metrics refuses a second declaration of a name with other help text or labels
    (the overload queue and the per-key queue once both declared router_queue_waiting,
    each overwriting the other)."""
    m = Metrics(CollectorRegistry())
    g = m.gauge("x_waiting", "requests waiting")
    assert m.gauge("x_waiting", "requests waiting") is g  # same meaning: idempotent
    with pytest.raises(ValueError, match="x_waiting"):
        m.gauge("x_waiting", "requests in another queue")
    with pytest.raises(ValueError, match="x_waiting"):
        m.gauge("x_waiting", "requests waiting", ["key"])
    # across Metrics objects on one registry (two components of one process)
    reg = CollectorRegistry()
    Metrics(reg).counter("y", "one thing", ["a"])
    with pytest.raises(ValueError, match="pdserve_y"):
        Metrics(reg).counter("y", "another thing", ["a"])


def test_every_router_metric_is_declared_once_with_one_meaning():
    """All of the router's metric sets on one registry: a clash raises here."""
    from pdserve.router.app import RouterApp
    from pdserve.router.flip.controller import FlipMetrics
    from pdserve.router.scheduling.length import LengthMetrics
    from pdserve.router.settings import RouterSettings

    m = Metrics(CollectorRegistry())
    app = RouterApp(RouterSettings(), metrics=m)  # RouterMetrics + the admission stage's
    LengthMetrics(m)
    FlipMetrics(m)
    assert app.admission.metrics.waiting is m.gauge(
        "router_queue_waiting", "requests waiting in the admission queue for a turn"
    )
