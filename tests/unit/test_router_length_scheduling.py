"""Scheduling that reads the length prediction: decode placement by predicted KV
footprint (fake registry instances), the overload queue's order and aging, and
the flip controller's predicted decode demand."""

import asyncio

import pytest

from pdserve.router.cluster.registry import ROLE_DECODE, ROLE_PREFILL, Instance, LoadReport
from pdserve.router.flip.policy import FlipPolicy, FlipThresholds, InstanceLoad
from pdserve.router.scheduling.decode_placement import PredictedFootprint
from pdserve.router.scheduling.demand import DecodeDemand
from pdserve.router.scheduling.factory import make_policy
from pdserve.router.scheduling.overload_queue import OverloadQueue
from pdserve.router.scheduling.policies import RouteRequest


def decode(iid, inflight_requests=0, total_blocks=1000, block_size=16):
    return Instance(
        instance_id=iid,
        address=f"{iid}:1",
        role=ROLE_DECODE,
        model_fingerprint="fp",
        block_size=block_size,
        load=LoadReport(total_blocks=total_blocks, free_blocks=total_blocks),
        last_heartbeat=0.0,
        inflight_requests=inflight_requests,
    )


def route(rid, prompt=100, predicted=50):
    return RouteRequest(rid, [1] * prompt, predicted_tokens=predicted)


def test_demand_tracks_footprint_progress_and_outliving():
    d = DecodeDemand(min_remaining=8)
    d.add("r1", "a", prompt_tokens=100, predicted_tokens=50)
    assert d.footprint("a") == 150
    d.progress("r1", 30)
    assert d.footprint("a") == 150 and d.current_tokens("a") == 130
    d.progress("r1", 40)  # outlived its prediction: a tail guess, never negative
    (p,) = d.placements("a")
    assert d.remaining(p) == max(8, 70 // 4)
    assert d.overlap("a", 4) == pytest.approx(170 * 4 + 8)
    d.remove("r1")
    assert d.footprint("a") == 0 and len(d) == 0


def test_placement_follows_predictions_not_counts():
    demand = DecodeDemand()
    a, b = decode("a", inflight_requests=1), decode("b", inflight_requests=3)
    demand.add("long", "a", 100, 2000)  # one request predicted to run long
    for i in range(3):
        demand.add(f"s{i}", "b", 100, 10)  # three short ones about to finish
    predicted = make_policy("least_loaded", decode_placement="predicted", demand=demand)
    count = make_policy("least_loaded")
    assert isinstance(predicted, PredictedFootprint)
    new = route("new", predicted=500)
    assert count.pick_decode(new, [a, b]).instance_id == "a"  # fewer requests
    assert predicted.pick_decode(new, [a, b]).instance_id == "b"  # less KV over its lifetime
    # flip the predictions: now the long one is on b
    demand2 = DecodeDemand()
    demand2.add("long", "b", 100, 2000)
    for i in range(3):
        demand2.add(f"s{i}", "a", 100, 10)
    p2 = make_policy("least_loaded", decode_placement="predicted", demand=demand2)
    assert p2.pick_decode(new, [a, b]).instance_id == "a"


def test_placement_avoids_predicted_kv_overflow():
    demand = DecodeDemand()
    small, big = decode("a", total_blocks=20), decode("b", total_blocks=10_000)
    demand.add("x", "a", 100, 100)  # same batch on both...
    demand.add("y", "b", 100, 100)
    p = make_policy("round_robin", decode_placement="predicted", demand=demand)
    # ...but on the small one (320 tokens of KV) the predicted peak would not fit
    assert p.pick_decode(route("n", prompt=100, predicted=50), [small, big]).instance_id == "b"
    with pytest.raises(ValueError, match="decode placement"):
        make_policy("least_loaded", decode_placement="bogus")


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def _admit_order(queue: OverloadQueue, predicted: list[int], clock=None, step=0.0):
    order: list[int] = []

    async def one(i: int, n: int) -> None:
        await queue.acquire(n)
        order.append(i)

    tasks = []
    for i, n in enumerate(predicted):
        tasks.append(asyncio.create_task(one(i, n)))
        await asyncio.sleep(0)
    while len(order) < len(predicted):
        if clock is not None:
            clock.t += step
        queue.release()
        await asyncio.sleep(0)
        await asyncio.sleep(0)
    await asyncio.gather(*tasks)
    return order


async def test_queue_orders_by_prediction_and_fcfs_is_selectable():
    for order, expect in (("sjf", [2, 0, 3, 1]), ("fcfs", [0, 1, 2, 3])):
        q = OverloadQueue(lambda: 1, order=order, aging_tokens_per_s=0.0)
        await q.acquire(0)  # the one running request: everyone else waits
        got = await _admit_order(q, [50, 900, 10, 300])
        assert got == expect, order
        assert q.running == 1  # the last admitted still runs
    with pytest.raises(ValueError, match="queue order"):
        OverloadQueue(lambda: 1, order="lifo")


async def test_no_limit_means_no_waiting():
    q = OverloadQueue(lambda: 0)
    assert [await q.acquire(n) for n in (5, 1, 9)] == [0.0, 0.0, 0.0]
    assert q.waiting == 0 and q.running == 3


async def test_aging_bounds_the_wait_of_a_long_request():
    """A long request keeps losing to fresh short ones until its age wins: with aging
    it gets in after about predicted/aging seconds; `max_wait_s` is a hard bound."""
    for aging, max_wait, bound in ((100.0, 1e9, 11), (0.0, 5.0, 6)):
        clock = FakeClock()
        q = OverloadQueue(
            lambda: 1,
            order="sjf",
            aging_tokens_per_s=aging,
            max_wait_s=max_wait,
            max_bypass=0.0,
            clock=clock,
        )
        await q.acquire(0)
        admitted: list[str] = []

        async def one(name: str, n: int, q=q, admitted=admitted) -> None:
            await q.acquire(n)
            admitted.append(name)

        long_task = asyncio.create_task(one("long", 1000))
        await asyncio.sleep(0)
        tasks = [long_task]
        for i in range(40):  # one short arrival per second, one finish per second
            tasks.append(asyncio.create_task(one(f"s{i}", 10)))
            await asyncio.sleep(0)
            clock.t += 1.0
            q.release()
            await asyncio.sleep(0)
            if "long" in admitted:
                break
        assert "long" in admitted, (aging, max_wait)
        assert admitted.index("long") <= bound
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_bypass_bound_relative_to_the_fcfs_turn():
    """Without aging, a long request behind a steady stream of short ones is let in once
    max_bypass x its FCFS turn admissions happened since it arrived."""
    q = OverloadQueue(lambda: 1, order="sjf", aging_tokens_per_s=0.0, max_bypass=2.0)
    await q.acquire(0)
    admitted: list[str] = []

    async def one(name: str, n: int) -> None:
        await q.acquire(n)
        admitted.append(name)

    tasks = [asyncio.create_task(one("s-first", 10))]
    await asyncio.sleep(0)
    tasks.append(asyncio.create_task(one("long", 1000)))  # FCFS turn 2
    await asyncio.sleep(0)
    for i in range(10):
        tasks.append(asyncio.create_task(one(f"s{i}", 10)))
        await asyncio.sleep(0)
        q.release()
        await asyncio.sleep(0)
    assert admitted.index("long") == 3  # the 4th admission since it arrived = 2 x its turn
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_cancelled_waiter_leaves_the_queue():
    q = OverloadQueue(lambda: 1)
    await q.acquire(0)
    t = asyncio.create_task(q.acquire(5))
    await asyncio.sleep(0)
    assert q.waiting == 1
    t.cancel()
    await asyncio.gather(t, return_exceptions=True)
    assert q.waiting == 0
    q.release()
    assert q.running == 0


def test_flip_pressure_reads_predicted_decode_demand():
    pools = [
        InstanceLoad("p0", ROLE_PREFILL, "serving"),
        InstanceLoad("p1", ROLE_PREFILL, "serving"),
        InstanceLoad(
            "d0", ROLE_DECODE, "serving", num_running=2, free_blocks=90, total_blocks=100,
            block_size=16, predicted_kv_tokens=1800,
        ),
    ]  # fmt: skip
    policy = FlipPolicy(FlipThresholds(ticks=1, cooldown_s=0.0))
    p = policy.pressure(pools)
    assert p.decode_predicted_fraction == pytest.approx(1800 / 1600)
    assert p.decode == pytest.approx(1800 / 1600)  # not the 10 % of blocks used right now
    decision = policy.decide(pools, now=0.0)
    assert decision.action == "flip" and decision.to_role == ROLE_DECODE


def test_flip_snapshot_carries_the_predicted_demand():
    from pdserve.router.cluster.registry import Registry
    from pdserve.router.flip.controller import snapshot

    reg = Registry()
    reg.register("d0", "d0:1", ROLE_DECODE, "fp", 16, LoadReport(total_blocks=10, free_blocks=10))
    demand = DecodeDemand()
    demand.add("r", "d0", prompt_tokens=100, predicted_tokens=60)
    (load,) = snapshot(reg, demand)
    assert load.predicted_kv_tokens == 160 and load.block_size == 16
    (plain,) = snapshot(reg)
    assert plain.predicted_kv_tokens == 0
