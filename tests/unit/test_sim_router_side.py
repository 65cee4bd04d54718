"""`sim` reads the router's flags as the router does, and builds the router's objects."""

from __future__ import annotations

from pdserve.costmodel.costs import CostModel, StepCost
from pdserve.router.app import RouterApp
from pdserve.router.scheduling.admission import Admission
from pdserve.router.scheduling.decode_placement import PredictedFootprint
from pdserve.router.scheduling.policies import SessionAffinity
from pdserve.router.scheduling.predictor import OraclePredictor
from pdserve.router.scheduling.predictor.online import OnlineLengthPredictor
from pdserve.sim.cluster import SimCluster
from pdserve.sim.router_side import (
    build_admission,
    build_length,
    build_predictor,
    router_settings,
)
from pdserve.sim.run import spec_from_up_flags, text_prompt_ids
from pdserve.workload.requests import BenchRequest

COSTS = CostModel(step=StepCost(base_s=0.01, per_token_s=0.0001), kv_bytes_per_token=100)
FLAGS = [
    "--router-arg=--queue-max-running-per-decode=3 --queue-order=fcfs",
    "--router-arg=--queue-max-bypass=4",
    "--router-arg=--decode-placement=predicted",
    "--router-arg=--reserve-max-tokens=128",
    "--router-arg=--predictor-oracle --no-session-affinity",
    "--router-arg=--flip-enabled --flip-ticks=5 --flip-ratio=2 --flip-interval-s=0.5",
    "--policy", "least_loaded",
]  # fmt: skip


def test_every_decision_flag_reaches_the_simulated_router():
    spec = spec_from_up_flags(["--mode", "disagg", *FLAGS], COSTS, 4096)
    rs = spec.router
    assert rs is not None
    adm = rs.admission
    assert (adm.queue_max_running_per_decode, adm.queue_order, adm.queue_max_bypass) == (
        3, "fcfs", 4
    )  # fmt: skip
    assert (rs.placement.decode_placement, rs.placement.reserve_max_tokens) == ("predicted", 128)
    assert rs.length.predictor_oracle
    assert spec.policy == "least_loaded" and spec.session_affinity is False
    assert spec.flip is not None and (spec.flip.ticks, spec.flip.ratio) == (5, 2.0)
    assert spec.flip_interval_s == 0.5
    c = SimCluster(spec)
    assert isinstance(c.policy, PredictedFootprint) and c.policy.demand is c.demand
    assert c.length is not None and c.length.demand is c.demand
    assert isinstance(c.admission, Admission) and c.admission.queue.max_bypass == 4
    assert c.admission.limit() == 3  # 3 per serving decode, one decode
    assert c.length.reserve_max_tokens == 128 and c.length.oracle
    assert isinstance(c.length.predictor, OraclePredictor)


def test_the_same_objects_as_router_app():
    flags = ["--queue-max-running-per-decode=2", "--decode-placement=predicted",
             "--reserve-max-tokens=64", "--no-predictor-use-max-tokens"]  # fmt: skip
    s = router_settings(flags)
    app = RouterApp(s)
    theirs = app._length_scheduling(app._predictor())
    ours = build_length(s, build_predictor(s), app.demand)
    assert type(app.policy) is SessionAffinity and type(app.policy.inner) is PredictedFootprint
    for attr in ("reserve_max_tokens", "oracle", "use_max_tokens"):
        assert getattr(ours, attr) == getattr(theirs, attr)
    assert ours.is_needed() == theirs.is_needed()  # the router asks per request
    assert type(ours.predictor) is type(theirs.predictor) is OnlineLengthPredictor
    assert (ours.predictor.text_model is None) == (theirs.predictor.text_model is None)
    adm = build_admission(s, lambda: 1, lambda: 0.0)
    assert adm.config == app.admission.config
    for attr in ("order", "aging_tokens_per_s", "max_wait_s", "max_bypass"):
        assert getattr(adm.queue, attr) == getattr(app.admission.queue, attr)


def test_no_predictor_runs_when_nothing_reads_it():
    spec = spec_from_up_flags(["--mode", "disagg"], COSTS, 4096)
    c = SimCluster(spec)
    assert c.length is None and c.admission is None


def test_text_prompts_are_predicted_from_their_text():
    """The shipped text model (run on a thread, as the router runs it) sees the prompt text:
    two prompts of equal token count get different predictions."""
    spec = spec_from_up_flags(
        ["--mode", "disagg", "--router-arg=--decode-placement=predicted",
         "--router-arg=--no-predictor-use-max-tokens"], COSTS, 4096,
    )  # fmt: skip
    short = "Answer yes or no: is 7 prime? Reply in one word only, nothing else please."
    long_ = "Write a detailed, multi-section essay on the history of the Roman Empire ..."
    reqs = [BenchRequest(0, [], 20, prompt_text=short), BenchRequest(1, [], 20, prompt_text=long_)]
    text_prompt_ids(reqs, 1000)
    assert reqs[0].prompt_ids and len(reqs[0].prompt_ids) == round(len(short) / 4)
    c = SimCluster(spec)
    seen = {}
    orig = c.length.predict

    async def spy(job, route, bs):
        t = await orig(job, route, bs)
        seen[job.request_id] = t.estimate.p50
        return t

    c.length.predict = spy
    recs = c.run(reqs)
    assert all(r.error is None and r.n_out == 20 for r in recs)
    assert seen["r0"] < seen["r1"]


def _burst(n: int) -> list[BenchRequest]:
    return [
        BenchRequest(i, [10 + (i * 7 + k) % 900 for k in range(64)], 50, arrival_s=i * 0.001)
        for i in range(n)
    ]


def test_the_admission_stage_bounds_the_queue_in_simulated_time():
    """--max-queue and --queue-timeout-s reach the simulated router's `Admission`: a full
    queue refuses at once, a waiter past its timeout is refused, both on the simulated
    clock (a run far shorter in wall time than the timeout still sees it expire)."""
    costs = {"prefill": COSTS, "decode": CostModel(step=StepCost(base_s=0.02))}
    base = ["--mode", "disagg", "--decode", "1", "--worker-arg=--num-blocks=400"]
    flags = ["--router-arg=--queue-max-running-per-decode=2 --queue-order=fcfs"]

    def run(extra: list[str]) -> tuple[list[str], list[str]]:
        c = SimCluster(spec_from_up_flags([*base, *flags, *extra], costs, 4096))
        recs = c.run(_burst(12))
        return c.admitted, [r.error or "" for r in recs]

    admitted, errors = run([])
    assert admitted == [f"r{i}" for i in range(12)] and not any(errors)
    admitted, errors = run(["--router-arg=--max-queue=3"])
    assert admitted == ["r0", "r1", "r2", "r3", "r4"]  # 2 running + 3 waiting
    assert all("max_queue=3" in e for e in errors[5:])
    # each request holds its turn ~1 s (50 tokens x 20 ms): the third waits ~1 s
    admitted, errors = run(["--router-arg=--queue-timeout-s=0.5"])
    assert admitted == ["r0", "r1"]
    assert all("no turn within 0.5 s" in e for e in errors[2:])


def test_the_front_doors_prompt_limit_refuses_in_the_simulator():
    spec = spec_from_up_flags(
        ["--mode", "disagg", "--router-arg=--max-prompt-tokens=100"], COSTS, 4096
    )
    reqs = [BenchRequest(0, list(range(10, 90)), 5), BenchRequest(1, list(range(10, 130)), 5)]
    recs = SimCluster(spec).run(reqs)
    assert recs[0].error is None and recs[0].n_out == 5
    assert recs[1].error and "max_prompt_tokens=100" in recs[1].error and recs[1].n_out == 0


def test_a_full_decode_wakes_its_waiters_when_a_request_leaves():
    """Every decode full: the reservation waits as `admission.Capacity` does, woken by the
    registry change of a request leaving the decode (not by a back-off timer)."""
    costs = {"prefill": COSTS, "decode": CostModel(step=StepCost(base_s=0.013))}
    flags = ["--mode", "disagg", "--worker-arg=--num-blocks=6 --block-size=16"]
    spec = spec_from_up_flags(flags, costs, 4096)
    spec.heartbeat_interval_s = 1e9  # no heartbeat wake-ups after t = 0
    c = SimCluster(spec)
    dec = c.instances["decode-0"]
    reserved: dict[str, float] = {}
    left: list[float] = []
    orig_reserve, orig_charge = dec.reserve, c.registry.charge

    def reserve(rid, n, n_kv=0):
        ok = orig_reserve(rid, n, n_kv)
        if ok:
            reserved[rid] = c.loop.now
        return ok

    def charge(iid, requests=0, tokens=0):
        if iid == "decode-0" and requests < 0:
            left.append(c.loop.now)
        orig_charge(iid, requests, tokens)

    dec.reserve = reserve  # type: ignore[method-assign]
    c.registry.charge = charge  # type: ignore[method-assign]
    prompt = list(range(10, 74))  # 64 tokens: 5 blocks with token 0; two do not fit in 6
    recs = c.run([BenchRequest(0, prompt, 20), BenchRequest(1, prompt, 20, arrival_s=0.001)])
    assert all(r.error is None and r.n_out == 20 for r in recs)
    assert reserved["r1"] > reserved["r0"] and reserved["r1"] == left[0]
