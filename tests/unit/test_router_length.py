"""LengthScheduling: what the orchestrator calls around a request's lifecycle."""

from pdserve.engine.params import SamplingParams
from pdserve.router.job import Job
from pdserve.router.scheduling.length import UNBOUNDED, LengthScheduling
from pdserve.router.scheduling.policies import RouteRequest
from pdserve.router.scheduling.predictor import EwmaPredictor, OraclePredictor
from pdserve.router.scheduling.predictor.online import OnlineLengthPredictor


def job(rid="r", max_tokens=100, oracle=0, text=None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Job(
        rid,
        [1, 2, 3, 4, 5, 6, 7, 8],
        params,
        prompt_text=text,
        model="m",
        oracle_tokens=oracle,
    )


async def test_predict_fills_the_route_and_bounds_the_headroom():
    ls = LengthScheduling(EwmaPredictor(initial=40), reserve_max_tokens=50)
    j = job(max_tokens=30)
    route = RouteRequest(j.request_id, j.token_ids)
    t = await ls.predict(j, route, block_size=4)
    ls.route(t, j, route)
    assert route.predicted_tokens == 30  # clamped to max_tokens
    assert route.reserve_tokens == 30  # min(p90, 50, max_tokens)
    ls2 = LengthScheduling(EwmaPredictor(initial=40), reserve_max_tokens=50, use_max_tokens=False)
    route2 = RouteRequest(j.request_id, j.token_ids)
    t2 = await ls2.predict(j, route2, block_size=4)
    ls2.route(t2, j, route2)
    assert t2.query.max_tokens == UNBOUNDED and route2.predicted_tokens == 40
    assert route2.reserve_tokens == 30  # headroom never beyond max_tokens
    assert t.query.model == "m"


async def test_oracle_only_when_enabled_and_learning_only_from_finished_requests():
    inner = OnlineLengthPredictor(initial=10)
    ls = LengthScheduling(OraclePredictor(inner), oracle=True)
    route = RouteRequest("a", [1, 2, 3])
    t = await ls.predict(job("a", oracle=77), route, 4)
    assert t.predicted_tokens == 77
    ls_off = LengthScheduling(OraclePredictor(inner), oracle=False)
    route_off = RouteRequest("b", [1, 2, 3])
    t_off = await ls_off.predict(job("b", oracle=77), route_off, 4)
    assert t_off.predicted_tokens == 10  # metadata ignored without the flag
    ls.done(t, 50, finished=False)  # cancelled: censored, not learned
    assert ls.learned == 0
    ls.done(t, 50, finished=True)
    assert ls.learned == 1


async def test_demand_follows_the_request_across_attempts():
    ls = LengthScheduling(EwmaPredictor(initial=20))
    j1 = job("1")
    r1 = RouteRequest("1", j1.token_ids)
    t1 = await ls.predict(j1, r1, 4)
    ls.placed(t1, "d0", 8, ls.route(t1, j1, r1))
    ls.progress(t1, 5)
    assert ls.demand.current_tokens("d0") == 13
    ls.left(t1)  # the attempt broke: its decode no longer holds it
    assert ls.demand.footprint("d0") == 0 and ls.learned == 0
    ls.done(t1, 5, finished=True)
    assert ls.learned == 1


async def test_a_continuation_is_routed_on_what_is_left_and_learned_as_the_whole():
    """A migrated stream keeps its request's prediction: its route asks for what is left
    of it, and the predictor learns the request's whole length once (not the piece)."""
    learned = []

    class Spy(EwmaPredictor):
        def learn(self, query, actual):
            learned.append((query.num_prompt_tokens, actual))

    ls = LengthScheduling(Spy(initial=40), reserve_max_tokens=64)
    j = job("r", max_tokens=100)
    t = await ls.predict(j, RouteRequest("r", j.token_ids), 4)
    part = j.__class__(**{**j.__dict__, "request_id": "r.m1", "token_ids": [*j.token_ids, 9] * 3})
    part.params = SamplingParams(max_tokens=70, temperature=0.0, ignore_eos=True)  # 30 out
    route = ls.route(t, part, RouteRequest(part.request_id, part.token_ids))
    assert route.predicted_tokens == 10 and route.reserve_tokens <= 70
    ls.done(t, 95, finished=True)
    assert learned == [(8, 95)]  # the client's prompt and the whole output


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


async def test_the_predictor_does_not_run_when_nothing_reads_it():
    from pdserve.config import load_settings
    from pdserve.router.app import RouterApp
    from pdserve.router.settings import RouterSettings

    calls = []

    class Spy(EwmaPredictor):
        def estimate(self, query):
            calls.append(query)
            return super().estimate(query)

        def learn(self, query, actual):
            calls.append(actual)

    ls = LengthScheduling(Spy(initial=20), needed=False)
    j = job("q", max_tokens=50)
    t = await ls.predict(j, RouteRequest("q", j.token_ids), 4)
    assert t.predicted_tokens == 50 and not t.estimated  # max_tokens stands in
    ls.done(t, 10, finished=True)
    assert calls == [] and ls.learned == 0
    # the router's defaults read nothing; an SJF queue, predicted placement or KV headroom do
    assert not RouterApp(RouterSettings())._predictions_needed()
    for flags in (
        ["--max-running", "4"],
        ["--decode-placement", "predicted"],
        ["--reserve-max-tokens", "32"],
    ):
        assert RouterApp(load_settings(RouterSettings, flags))._predictions_needed(), flags
    assert not RouterApp(
        load_settings(RouterSettings, ["--max-running", "4", "--queue-order", "fcfs"])
    )._predictions_needed()
