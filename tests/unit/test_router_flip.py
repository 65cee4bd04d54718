"""Flip controller: the pure decision (FlipPolicy) with synthetic loads and explicit times,
and the act of flipping (FlipController) against a real Registry and a fake worker stub."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdserve.router.cluster.registry import (
    ROLE_COLOCATED,
    ROLE_DECODE,
    ROLE_PREFILL,
    LoadReport,
    Registry,
)
from pdserve.router.flip.controller import FlipController, FlipMetrics, snapshot
from pdserve.router.flip.policy import FlipPolicy, FlipThresholds, InstanceLoad
from pdserve.rpc.metrics import Metrics

P, D = ROLE_PREFILL, ROLE_DECODE
# Pressure 1.0 = 1000 prompt tokens per prefill instance / 10 running seqs per decode instance.
T = FlipThresholds(
    prefill_tokens_full=1000, decode_seqs_full=10, starved=1.0, ratio=3.0, ticks=3, cooldown_s=10
)


def prefill(iid: str, tokens: int = 0, state: str = "serving", **kw) -> InstanceLoad:
    return InstanceLoad(
        iid, P, state, inflight_tokens=tokens, free_blocks=100, total_blocks=100, **kw
    )


def decode(iid: str, running: int = 0, free: int = 100, requests: int = 0, **kw) -> InstanceLoad:
    return InstanceLoad(
        iid, D, kw.pop("state", "serving"), inflight_requests=requests, num_running=running,
        free_blocks=free, total_blocks=100, **kw,
    )  # fmt: skip


def run_ticks(policy: FlipPolicy, pools, start: float, n: int, step: float = 1.0):
    return [policy.decide(pools, start + k * step) for k in range(n)]


# ------------------------------------------------------------------ policy (pure)
def test_pressure_units():
    pools = [prefill("p0", 1500), prefill("p1", 500), decode("d0", running=5, free=20)]
    p = FlipPolicy(T).pressure(pools)
    assert p.prefill == pytest.approx(1.0)  # 2000 tokens over 2 instances / 1000
    assert p.decode == pytest.approx(0.8)  # max(5 / 10, 80 of 100 blocks used)
    assert (p.n_prefill, p.n_decode, p.prefill_tokens, p.decode_running) == (2, 1, 2000, 5)


def test_flip_when_prefill_starved_picks_least_loaded_decode():
    policy = FlipPolicy(T)
    pools = [prefill("p0", 4000), decode("d0", running=1, requests=3), decode("d1", requests=1)]
    first, second, third = run_ticks(policy, pools, 0.0, 3)
    assert first.action == second.action == "hold"
    assert "hysteresis" in first.reason and first.streak == 1 and second.streak == 2
    assert third.action == "flip"
    assert (third.instance_id, third.from_role, third.to_role) == ("d1", D, P)
    assert third.pressure.prefill == pytest.approx(4.0)


def test_flip_back_when_decode_starved():
    policy = FlipPolicy(T)
    pools = [prefill("p0", 4000), decode("d0"), decode("d1")]
    flips = [d for d in run_ticks(policy, pools, 0.0, 3) if d.action == "flip"]
    assert len(flips) == 1 and flips[0].instance_id == "d0"
    policy.flip_ended(3.0)
    # d0 now serves prefill; the load turns decode-heavy: 30 running on the one decode.
    pools = [prefill("p0", 100), prefill("d0"), decode("d1", running=30, free=60)]
    decisions = run_ticks(policy, pools, 20.0, 3)  # well after the cooldown
    assert [d.action for d in decisions] == ["hold", "hold", "flip"]
    back = decisions[-1]
    assert (back.instance_id, back.from_role, back.to_role) == ("d0", P, D)  # the idle prefill
    assert back.pressure.decode == pytest.approx(3.0)


def test_no_flip_inside_the_cooldown():
    policy = FlipPolicy(T)
    policy.flip_ended(100.0)
    pools = [prefill("p0", 5000), decode("d0"), decode("d1")]
    decisions = run_ticks(policy, pools, 101.0, 8)  # t = 101 .. 108 < 110
    assert all(d.action == "hold" for d in decisions)
    assert "cooldown" in decisions[-1].reason
    assert policy.decide(pools, 110.0).action == "flip"  # the streak held all along


def test_never_empties_a_pool():
    policy = FlipPolicy(T)
    pools = [prefill("p0", 9000), decode("d0")]  # decode idle but alone
    decisions = run_ticks(policy, pools, 0.0, 10)
    assert all(d.action == "hold" for d in decisions)
    assert "one instance" in decisions[-1].reason
    pools = [prefill("p0"), decode("d0", running=90)]  # the other direction
    assert all(d.action == "hold" for d in run_ticks(policy, pools, 20.0, 10))


def test_suspect_flipping_or_colocated_instances_do_not_count_as_donors():
    policy = FlipPolicy(T)
    pools = [
        prefill("p0", 9000),
        decode("d0"),
        decode("d1", state="suspect"),
        InstanceLoad("c0", ROLE_COLOCATED, "serving"),
    ]
    assert all(d.action == "hold" for d in run_ticks(policy, pools, 0.0, 6))
    pools[1] = decode("d0", state="flipping")
    assert policy.decide(pools, 10.0).reason == "flip in progress"


def test_does_not_starve_the_donor_pool():
    policy = FlipPolicy(T)
    # Prefill starved (3.0), decode at 0.6 of its blocks: with one decode fewer it would be
    # at 1.2 (starved), so the flip would only move the shortage.
    pools = [prefill("p0", 3000), decode("d0", free=40), decode("d1", free=40)]
    decisions = run_ticks(policy, pools, 0.0, 6)
    assert all(d.action == "hold" for d in decisions)
    assert "would be starved" in decisions[-1].reason


def test_no_flapping_on_noise():
    policy = FlipPolicy(T)
    busy = [prefill("p0", 5000), decode("d0"), decode("d1")]
    quiet = [prefill("p0", 200), decode("d0"), decode("d1")]
    # Starved for two ticks at a time, then one quiet tick: the streak never reaches three.
    for k in range(30):
        d = policy.decide(busy if k % 3 != 2 else quiet, float(k))
        assert d.action == "hold"
    # Alternating starved pools never add up either.
    policy = FlipPolicy(T)
    decode_heavy = [prefill("p0"), prefill("p1"), decode("d0", running=40)]
    prefill_heavy = [prefill("p0", 9000), prefill("p1", 9000), decode("d0")]
    for k in range(30):
        d = policy.decide(decode_heavy if k % 2 else prefill_heavy, float(k))
        assert d.action == "hold"
        assert d.streak == 1


def test_both_pools_busy_is_not_starvation():
    policy = FlipPolicy(T)
    pools = [prefill("p0", 2000), decode("d0", running=10), decode("d1", running=10)]
    decisions = run_ticks(policy, pools, 0.0, 6)  # prefill 2.0 < 3 x decode 1.0
    assert all(d.action == "hold" and d.reason == "balanced" for d in decisions)


# ------------------------------------------------------------------ controller (act)
class FakeStub:
    def __init__(self, fail: grpc.StatusCode | None = None) -> None:
        self.calls: list[int] = []
        self.release = asyncio.Event()
        self.entered = asyncio.Event()
        self.fail = fail

    async def SetRole(self, request, timeout=None):
        from pdserve.v1 import worker_pb2

        self.calls.append(request.role)
        self.entered.set()
        await self.release.wait()  # the worker drains here
        if self.fail is not None:
            raise grpc.aio.AioRpcError(
                self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(), "worker is draining"
            )
        return worker_pb2.SetRoleResponse(role=request.role)


class FakeWorkers:
    def __init__(self, stub: FakeStub) -> None:
        self._stub = stub
        self.addresses: list[str] = []

    def stub(self, address: str) -> FakeStub:
        self.addresses.append(address)
        return self._stub


def make_cluster(clock) -> Registry:
    reg = Registry(heartbeat_timeout_s=1e9, clock=clock)
    reg.register("p0", "127.0.0.1:1", P, "fp", 16, LoadReport(free_blocks=64, total_blocks=64))
    for iid, port in (("d0", 2), ("d1", 3)):
        reg.register(
            iid, f"127.0.0.1:{port}", D, "fp", 16, LoadReport(free_blocks=64, total_blocks=64)
        )
    reg.charge("p0", requests=8, tokens=8000)  # 8 long prompts waiting for the prefill
    reg.charge("d0", requests=5)
    reg.charge("d1", requests=3)
    return reg


def make_controller(reg: Registry, stub: FakeStub, clock, changed: list[str]):
    metrics = Metrics(CollectorRegistry())
    ctl = FlipController(
        reg, FakeWorkers(stub), FlipPolicy(T), FlipMetrics(metrics),
        interval_s=0.01, on_role_changed=changed.append, clock=clock,
    )  # fmt: skip
    return ctl, metrics


async def tick(ctl: FlipController):
    return await asyncio.wait_for(ctl.tick(), 5)  # hang guard


async def test_controller_flips_decode_to_prefill():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    reg, stub, changed = make_cluster(clock), FakeStub(), []
    ctl, metrics = make_controller(reg, stub, clock, changed)
    assert [(await tick(ctl)).action for _ in range(2)] == ["hold", "hold"]
    task = asyncio.create_task(ctl.tick())
    await asyncio.wait_for(stub.entered.wait(), 5)
    # While the worker drains: marked, skipped by placement, visible in the snapshot.
    assert stub.calls == [P] and ctl.flipping == "d1"
    assert reg.get("d1").state == "flipping"
    assert [i.instance_id for i in reg.candidates(D)] == ["d0"]
    assert next(i for i in snapshot(reg) if i.instance_id == "d1").state == "flipping"
    assert metrics.value("router_flip_in_progress") == 1
    now[0] = 5.0
    stub.release.set()
    decision = await asyncio.wait_for(task, 5)
    assert decision.action == "flip" and decision.instance_id == "d1"
    d1 = reg.get("d1")
    assert (d1.role, d1.state) == (P, "serving")
    assert [i.instance_id for i in reg.candidates(P)] == ["d1", "p0"]
    assert changed == ["d1"] and ctl.flipping is None
    assert metrics.value("router_flips_total", {"direction": "decode_to_prefill"}) == 1
    assert metrics.value("router_flip_in_progress") == 0
    # Cooldown from the end of the flip (t=5): p0 is alone now anyway -> holds.
    assert (await tick(ctl)).action == "hold"


async def test_controller_failed_flip_unmarks_and_counts():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    reg, stub, changed = make_cluster(clock), FakeStub(grpc.StatusCode.UNAVAILABLE), []
    stub.release.set()
    ctl, metrics = make_controller(reg, stub, clock, changed)
    decisions = [await tick(ctl) for _ in range(3)]
    assert decisions[-1].action == "flip" and stub.calls == [P]
    d1 = reg.get("d1")
    assert (d1.role, d1.state) == (D, "serving")
    assert [i.instance_id for i in reg.candidates(D)] == ["d0", "d1"]
    assert changed == []
    assert metrics.value("router_flip_failures_total", {"direction": "decode_to_prefill"}) == 1
    assert metrics.value("router_flips_total", {"direction": "decode_to_prefill"}) is None
    # A failure starts the cooldown too: no retry storm against a refusing worker.
    later = [await tick(ctl) for _ in range(5)]
    assert all(d.action == "hold" for d in later) and "cooldown" in later[-1].reason
    now[0] = 11.0
    assert (await tick(ctl)).action == "flip"


async def test_controller_run_loop_ticks_until_cancelled():
    now = [0.0]
    clock = lambda: now[0]  # noqa: E731
    reg, stub, changed = make_cluster(clock), FakeStub(), []
    stub.release.set()
    ctl, _ = make_controller(reg, stub, clock, changed)
    task = asyncio.create_task(ctl.run())
    for _ in range(500):  # hang guard
        if changed:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert changed == ["d1"] and reg.get("d1").role == P
