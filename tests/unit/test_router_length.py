"""LengthScheduling: what the orchestrator calls around a request's lifecycle."""

import asyncio

from pdserve.engine.params import SamplingParams
from pdserve.router.job import Job
from pdserve.router.scheduling.length import UNBOUNDED, LengthScheduling
from pdserve.router.scheduling.overload_queue import OverloadQueue
from pdserve.router.scheduling.policies import RouteRequest
from pdserve.router.scheduling.predictor import EwmaPredictor, OraclePredictor
from pdserve.router.scheduling.predictor.online import OnlineLengthPredictor
from pdserve.v1 import common_pb2


def job(rid="r", max_tokens=100, oracle=0, text=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Job(
        rid,
        [1, 2, 3, 4, 5, 6, 7, 8],
        params,
        common_pb2.SamplingParams(max_tokens=max_tokens),
        prompt_text=text,
        model="m",
        oracle_tokens=oracle,
    )


async def test_predict_fills_the_route_and_bounds_the_headroom():
    ls = LengthScheduling(EwmaPredictor(initial=40), reserve_max_tokens=50)
    j = job(max_tokens=30)
    route = RouteRequest(j.request_id, j.token_ids)
    t = await ls.predict(j, route, block_size=4)
    assert route.predicted_tokens == 30  # clamped to max_tokens
    assert route.reserve_tokens == 30  # min(p90, 50, max_tokens)
    ls2 = LengthScheduling(EwmaPredictor(initial=40), reserve_max_tokens=50, use_max_tokens=False)
    route2 = RouteRequest(j.request_id, j.token_ids)
    t2 = await ls2.predict(j, route2, block_size=4)
    assert t2.query.max_tokens == UNBOUNDED and route2.predicted_tokens == 40
    assert route2.reserve_tokens == 30  # headroom never beyond max_tokens
    assert t.query.model == "m"


async def test_oracle_only_when_enabled_and_learning_only_from_finished_requests():
    inner = OnlineLengthPredictor(initial=10)
    ls = LengthScheduling(OraclePredictor(inner), oracle=True)
    route = RouteRequest("a", [1, 2, 3])
    t = await ls.predict(job("a", oracle=77), route, 4)
    assert route.predicted_tokens == 77
    ls_off = LengthScheduling(OraclePredictor(inner), oracle=False)
    route_off = RouteRequest("b", [1, 2, 3])
    await ls_off.predict(job("b", oracle=77), route_off, 4)
    assert route_off.predicted_tokens == 10  # metadata ignored without the flag
    ls.done(t, 50, finished=False)  # cancelled: censored, not learned
    assert ls.learned == 0
    ls.done(t, 50, finished=True)
    assert ls.learned == 1


async def test_demand_and_queue_slot_follow_the_request():
    q = OverloadQueue(lambda: 1)
    ls = LengthScheduling(EwmaPredictor(initial=20), queue=q)
    j1, j2 = job("1"), job("2")
    r1, r2 = RouteRequest("1", j1.token_ids), RouteRequest("2", j2.token_ids)
    t1 = await ls.predict(j1, r1, 4)
    t2 = await ls.predict(j2, r2, 4)
    await ls.admit(t1)
    waiter = asyncio.create_task(ls.admit(t2))
    await asyncio.sleep(0)
    assert not waiter.done() and q.waiting == 1
    ls.placed("1", "d0", 8, r1)
    ls.progress(t1, 5)
    assert ls.demand.current_tokens("d0") == 13
    ls.done(t1, 5, finished=True)
    await asyncio.wait_for(waiter, 1)
    assert ls.demand.footprint("d0") == 0 and q.running == 1
    ls.done(t2, 7, finished=True)
    assert q.running == 0 and ls.learned == 2


def test_oracle_metadata_parsing():
    from pdserve.router.frontdoor.servicer import oracle_tokens

    class Ctx:
        def __init__(self, md):
            self.md = md

        def invocation_metadata(self):
            return self.md

    assert oracle_tokens(Ctx((("x-request-id", "r"), ("pdserve-oracle-tokens", "42")))) == 42
    assert oracle_tokens(Ctx((("pdserve-oracle-tokens", "lots"),))) == 0
    assert oracle_tokens(Ctx(())) == 0
    assert oracle_tokens(object()) == 0
