"""What a CPU host adds to a step, in the cost model and the simulator: a busy neighbour's
slowdown (`CostModel.neighbour_busy_factor`, per role from a profile's `roles`), the
contention probe's factor per step kind (`KindScaledStep`), and the profile parts that
measure them (their arithmetic; the measurements themselves need a served cluster)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pdserve.costmodel.costs import CostModel, KindScaledStep, StepCost, plan_features
from pdserve.sim.cluster import ClusterSpec, PoolSpec, SimCluster
from pdserve.sim.instance import InstanceConfig, SimInstance
from pdserve.workload.requests import BenchRequest

STEP = StepCost(base_s=0.010, per_token_s=0.001)


def _req(i: int, n_in: int, n_out: int, at: float = 0.0) -> BenchRequest:
    return BenchRequest(i, [100 + i * 1000 + k for k in range(n_in)], n_out, arrival_s=at)


def _two_colocated(factor: float) -> ClusterSpec:
    costs = CostModel(step=STEP, kv_bytes_per_token=100, neighbour_busy_factor=factor)
    cfg = InstanceConfig(num_blocks=256, block_size=16)
    return ClusterSpec([PoolSpec("colocated", 2, costs, cfg)], policy="least_loaded")


def test_a_step_pays_the_neighbour_factor_only_while_another_instance_steps():
    # two 32-token prompts (10 + 32 = 42 ms alone each) at t = 0 on two instances: they
    # step together all along, each at 1 / 1.5 of its speed
    a, b = SimCluster(_two_colocated(1.5)).run([_req(0, 32, 1), _req(1, 32, 1)])
    assert (a.finish_s, b.finish_s) == pytest.approx((0.063, 0.063))
    a, b = SimCluster(_two_colocated(1.0)).run([_req(0, 32, 1), _req(1, 32, 1)])
    assert a.finish_s == b.finish_s == pytest.approx(0.042)
    # the second arrives half way: the first ran 21 ms alone, its other 21 ms take 31.5 ms
    # beside the second (ends at 52.5 ms); the second did 21 ms of work by then and runs its
    # last 21 ms alone (73.5 ms). Charged by the state at its start it would end at 84 ms.
    a, b = SimCluster(_two_colocated(1.5)).run([_req(0, 32, 1), _req(1, 32, 1, at=0.021)])
    assert (a.finish_s, b.finish_s) == pytest.approx((0.0525, 0.0735))
    # one after the other: nobody else is stepping, nobody pays
    a, b = SimCluster(_two_colocated(1.5)).run([_req(0, 32, 1), _req(1, 32, 1, at=0.1)])
    assert (a.finish_s, b.finish_s) == pytest.approx((0.042, 0.142))


def test_the_neighbour_factor_follows_the_neighbours_batch():
    """A factor by the neighbour's sequences in flight: 1.2 beside one, 2.0 beside four (1.2
    + 0.8 * (2 - 1) / 3 beside two), flat past the ends."""
    costs = CostModel(step=STEP, neighbour_points=((1.0, 1.2), (4.0, 2.0)))
    assert [costs.neighbour_factor(n) for n in (0, 1, 4, 9)] == pytest.approx([1.2, 1.2, 2.0, 2.0])
    assert costs.neighbour_factor(2) == pytest.approx(1.2 + 0.8 / 3)
    assert CostModel(neighbour_busy_factor=1.3).neighbour_factor(7) == 1.3
    back = CostModel.from_json(costs.to_json())
    assert back.neighbour_points == ((1.0, 1.2), (4.0, 2.0))
    # two colocated instances, a 32-token prompt each (42 ms alone): each steps beside a
    # step of 1 sequence, at 1 / 1.2 of its speed
    cfg = InstanceConfig(num_blocks=256, block_size=16)
    spec = ClusterSpec([PoolSpec("colocated", 2, costs, cfg)], policy="least_loaded")
    a, b = SimCluster(spec).run([_req(0, 32, 1), _req(1, 32, 1)])
    assert a.finish_s == b.finish_s == pytest.approx(0.042 * 1.2)


def test_an_engine_command_waits_for_the_step_in_flight_even_when_it_is_stretched():
    cluster = SimCluster(_two_colocated(1.5))
    inst = next(iter(cluster.instances.values()))
    inst.busy, inst.step_end = True, 0.010
    fired: list[float] = []
    cluster._after_step(inst, lambda: fired.append(cluster.loop.now))
    inst.step_end = 0.015  # re-timed meanwhile: a neighbour began to step
    cluster.loop.run()
    assert fired == [pytest.approx(0.015)]
    # the step ended on time and the next one began: the command runs between the two
    inst.busy, inst.step_end, fired[:] = True, 0.020, []
    cluster._after_step(inst, lambda: fired.append(cluster.loop.now))
    inst.steps += 1
    inst.step_end = 0.050
    cluster.loop.run()
    assert fired == [pytest.approx(0.020)]


def test_kind_scaled_step_scales_prompt_steps_and_decode_steps_apart():
    step = KindScaledStep(STEP, prefill=2.0, decode=3.0)
    assert step.step_s([(0, 10)]) == pytest.approx(0.020 * 2)
    assert step.step_s([(5, 1), (9, 1)]) == pytest.approx(0.012 * 3)
    assert step.step_s([(0, 10), (5, 1)]) == pytest.approx(0.021 * 2)  # a chunk: prefill
    assert step.step_s([]) == 0.0
    for batch in ([(0, 10)], [(5, 1), (9, 1)], [(3, 7), (5, 1)]):
        assert step.features_s(plan_features(batch)) == step.step_s(batch)
    # the simulated engine charges it through the features of its plans
    inst = SimInstance("i", 0, CostModel(step=step), InstanceConfig(num_blocks=64))
    inst.add("a", [5] * 10, max_tokens=3, prefill_only=False)
    plan, dur = inst.plan()
    assert dur == pytest.approx(0.020 * 2)
    inst.finish_step(plan, dur)
    _, dur = inst.plan()
    assert dur == pytest.approx(0.011 * 3)


def _profile(roles: dict | None) -> dict:
    costs = CostModel(step=STEP, stream_token_s=0.001, kv_bytes_per_token=64).to_json()
    floor = {"base_s": 0.008, "per_token_s": 0.0008}
    return {"costs": costs, "step_floor": floor, "roles": roles}


def test_a_profile_with_roles_gives_each_role_its_own_costs():
    from pdserve.sim.run import costs_of_profile

    assert isinstance(costs_of_profile(_profile(None)), CostModel)
    costs = costs_of_profile(_profile({"prefill": {"neighbour_busy_factor": 1.2},
                                       "decode": {"neighbour_busy_factor": 1.3}}))  # fmt: skip
    assert {r: c.neighbour_busy_factor for r, c in costs.items()} == {
        "prefill": 1.2,
        "decode": 1.3,
        "colocated": 1.0,
    }
    assert all(c.stream_token_s == 0.001 and c.step == STEP for c in costs.values())
    back = CostModel.from_json(CostModel(neighbour_busy_factor=1.7).to_json())
    assert back.neighbour_busy_factor == 1.7


def test_calibrated_costs_scale_the_floor_per_step_kind_and_keep_the_roles(tmp_path):
    from pdserve.cli.sim import calibrated_costs

    path = tmp_path / "p.json"
    path.write_text(json.dumps(_profile({"decode": {"neighbour_busy_factor": 1.3}})))
    cont = {"factor": 1.5, "prefill_factor": 1.1, "decode_factor": 1.9}
    costs = calibrated_costs(str(path), cont)
    assert costs["decode"].neighbour_busy_factor == 1.3
    assert costs["prefill"].neighbour_busy_factor == 1.0
    for c in costs.values():
        assert c.step.step_s([(0, 100)]) == pytest.approx((0.008 + 0.08) * 1.1)
        assert c.step.step_s([(100, 1)]) == pytest.approx((0.008 + 0.0008) * 1.9)
    path.write_text(json.dumps(_profile(None)))
    one = calibrated_costs(str(path), {"factor": 1.5})  # an older probe: one factor
    assert one.step.step_s([(0, 100)]) == pytest.approx(0.088 * 1.5)
    assert one.step.step_s([(100, 1)]) == pytest.approx(0.0088 * 1.5)


def test_contention_is_the_mean_of_the_probes_around_the_arm_per_kind():
    from pdserve.sim.validate import contention

    c = contention({"factor": 1.2, "prefill_factor": 1.0, "decode_factor": 1.4},
                   {"factor": 1.4, "prefill_factor": 1.2, "decode_factor": 1.6})  # fmt: skip
    assert (c["factor"], c["prefill_factor"], c["decode_factor"]) == pytest.approx((1.3, 1.1, 1.5))
    old = contention({"factor": 1.2}, {"factor": 1.4})
    assert old["prefill_factor"] == old["decode_factor"] == pytest.approx(1.3)


def test_served_1p1d_arithmetic():
    from pdserve.sim.profile_pd import engine_prefill_s, roles_of

    # a 1,200-token prompt alone runs as chunks of 512, 512 and 176 tokens
    assert engine_prefill_s(STEP, 1200, 512) == pytest.approx(3 * 0.010 + 1.200)
    assert engine_prefill_s(STEP, 100, 512) == pytest.approx(0.110)
    roles = roles_of({"prefill_factor": 1.25, "decode_factor": 1.0})
    assert roles == {"prefill": {"neighbour_busy_factor": 1.25},
                     "decode": {"neighbour_busy_factor": 1.0}}  # fmt: skip
    roles = roles_of({"prefill_factor": 1.25, "decode_factor": 1.0, "reserve_s": 0.003,
                      "prefill_factor_points": [(1.0, 1.1), (4.0, 1.25)],
                      "decode_stream_points": [(1.0, 0.001), (4.0, 0.002)]})  # fmt: skip
    assert roles["prefill"]["neighbour_points"] == [[1.0, 1.1], [4.0, 1.25]]
    assert roles["decode"]["stream_points"] == [[1.0, 0.001], [4.0, 0.002]]
    assert roles["decode"]["reserve_s"] == 0.003 and "reserve_s" not in roles["prefill"]


def test_the_served_decode_step_and_the_stream_points_of_the_1p1d_decode():
    from pdserve.sim.profile import prompt_steps
    from pdserve.sim.profile_pd import decode_stream_points, monotone_points
    from pdserve.sim.served_steps import StepCounters, mean_decode_step_s

    # 16 prompts of 64 tokens, 8 to a step of 512: 2 steps of 10 + 512 ms
    assert prompt_steps(STEP, 16, 64, 512) == (2, pytest.approx(2 * 0.522))
    # a window of 50 steps (2.0 s), 2 of them prompts (0.5 s): 48 decode steps of 31.25 ms
    window = StepCounters(150, 7.0).since(StepCounters(100, 5.0))
    assert mean_decode_step_s(window, 2, 0.5) == pytest.approx(1.5 / 48)
    assert mean_decode_step_s(None, 0, 0.0) is None
    assert mean_decode_step_s(StepCounters(2, 0.1), 2, 0.1) is None
    # never falling: a high point is averaged with the lower ones after it (least squares)
    pts = monotone_points({4: 0.6, 1: 0.1, 2: 1.2, 8: 2.5})
    assert pts == [(1, 0.1), (2, pytest.approx(0.9)), (4, pytest.approx(0.9)), (8, 2.5)]
    assert monotone_points({1: -0.3, 2: 0.2}) == [(1, 0.0), (2, 0.2)]
    assert monotone_points({1: 1.1, 4: 0.5}, floor=1.0) == [(1, 1.05), (4, 1.05)]
    # per round, per stream count: TPOT, the engine-only step, the decode's own step. The
    # machine ran 10 % slow in round 1 (read at 1 stream): the work per step is TPOT minus
    # the engine-only step x 1.1; without counters (round 2), x 1.
    got = [{"d_idle_points": [
               {"streams": 1, "tpot_s": 0.0230, "engine_step_s": 0.020, "served_step_s": 0.022},
               {"streams": 4, "tpot_s": 0.0300, "engine_step_s": 0.025, "served_step_s": 0.028}]},
           {"d_idle_points": [
               {"streams": 1, "tpot_s": 0.0205, "engine_step_s": 0.020, "served_step_s": None},
               {"streams": 4, "tpot_s": 0.0270, "engine_step_s": 0.025, "served_step_s": None}]}]  # fmt: skip
    pts = decode_stream_points(got)
    assert pts == [(1.0, pytest.approx((0.001 + 0.0005) / 2)),
                   (4.0, pytest.approx((0.0025 + 0.002) / 2))]  # fmt: skip


class _Engine:
    """Just enough of LLMEngine for the profile's sampling plan: records what it is given."""

    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.scheduler = argparse.Namespace(schedule=lambda: None)
        self.added: list[tuple[int, int]] = []
        self.steps = 0

    def step(self) -> None:
        self.steps += 1

    def has_unfinished_requests(self) -> bool:
        return False


def test_the_profile_samples_long_contexts_where_the_model_reaches_them():
    from pdserve.sim.profile import sample_long_contexts

    eng = _Engine(4096)
    sample_long_contexts(eng, lambda n, out: eng.added.append((n, out)), [], lambda: 0.0,
                         True, 512)  # fmt: skip
    # decodes at 2,048 tokens of context (1 + 4), then 2 and 6 long decodes + a 2,048 prompt
    assert eng.added == [(2048, 9)] * 5 + [(1024, 48)] * 2 + [(2048, 1)] + [(1024, 48)] * 6 + [
        (2048, 1)
    ]
    assert eng.steps == (4 + 1) + (12 + 1)  # the long decodes' prompts, unrecorded
    full = _Engine(4096)
    sample_long_contexts(full, lambda n, o: full.added.append((n, o)), [], lambda: 0.0,
                         False, 512)  # fmt: skip
    assert full.added.count((3072, 9)) == 5
    short = _Engine(1024)  # a short-context model: nothing to add
    sample_long_contexts(short, lambda n, o: short.added.append((n, o)), [], lambda: 0.0,
                         True, 512)  # fmt: skip
    assert short.added == []


def test_a_profile_that_probed_itself_scales_its_typical_fit_by_the_probe_ratio(tmp_path):
    from pdserve.cli.sim import calibrated_costs

    prof = _profile(None) | {"probe": {"factor": 0.9, "prefill_factor": 0.8, "decode_factor": 1.0}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    # the machine as fast as when profiled: the typical fit unchanged
    same = calibrated_costs(str(path), {"factor": 0.9, "prefill_factor": 0.8, "decode_factor": 1.0})
    assert same.step.step_s([(0, 100)]) == pytest.approx(STEP.step_s([(0, 100)]))
    assert same.step.step_s([(100, 1)]) == pytest.approx(STEP.step_s([(100, 1)]))
    # 10 % slower on prompt steps, 20 % on decodes than when profiled
    slow = calibrated_costs(
        str(path), {"factor": 1.0, "prefill_factor": 0.88, "decode_factor": 1.2}
    )
    assert slow.step.step_s([(0, 100)]) == pytest.approx(STEP.step_s([(0, 100)]) * 1.1)
    assert slow.step.step_s([(100, 1)]) == pytest.approx(STEP.step_s([(100, 1)]) * 1.2)


def test_the_disaggregated_prompt_extra_is_measured_against_served_colocated_prompts():
    from pdserve.sim.profile_pd import disaggregated_prompt_extra

    colocated = [{"tokens": n, "prefill_s": 0.020 + 0.0005 * n} for n in (8, 32, 128, 256)] * 3
    # the 1P1D stage: 5 ms + 10 us per token more than the colocated one, at any length;
    # a 1,024-token prompt (two chunks) and lengths the colocated profile lacks are left out
    paths = [{"tokens": n, "prefill_s": 0.025 + 0.00051 * n, "engine_step_s": 9.9}
             for n in (32, 128, 256, 512, 1024)]  # fmt: skip
    a, b = disaggregated_prompt_extra(paths, 512, colocated, (0.002, 0.0))
    assert (a, b) == (pytest.approx(0.007), pytest.approx(1e-5))
    # without a colocated reference: against the engine-only step (here far above: 0)
    assert disaggregated_prompt_extra(paths, 512, None, (0.002, 0.0)) == (0.0, 0.0)
    # with the prefill worker's own steps of a same-length prompt that pushes nothing: the
    # stage beyond them (the engine-only fit, 9.9 s, and the colocated reference unread)
    own = [p | {"served_step_s": 0.0004 * p["tokens"]} for p in paths]
    a, b = disaggregated_prompt_extra(own, 512, colocated, (0.002, 0.0))
    assert (a, b) == (pytest.approx(0.025), pytest.approx(0.00011))


def test_the_probe_reads_its_steps_against_the_floor_fit_per_step_kind():
    from pdserve.sim.probe import probe_factors

    # decodes at 0.9 of the fit, prompt steps at 1.2 (a 32-token prompt: 42 ms by the fit)
    samples = [{"batch": [(64, 1)] * 4, "s": 0.9 * STEP.step_s([(64, 1)] * 4)} for _ in range(5)]
    samples += [{"batch": [(0, 32)], "s": 1.2 * 0.042} for _ in range(2)]
    got = probe_factors(samples, STEP)
    assert got["decode_factor"] == pytest.approx(0.9)
    assert got["prefill_factor"] == pytest.approx(1.2)
    assert got["factor"] == pytest.approx(0.9) and got["steps"] == 7


def test_the_served_factors_are_the_arms_readings_over_its_profiles():
    from pdserve.sim.served_probe import served_factors

    ref = {"ttft_s": 0.020, "tpot_s": 0.010}
    f = served_factors(ref, {"ttft_s": 0.022, "tpot_s": 0.011}, {"ttft_s": 0.026, "tpot_s": 0.013})
    assert f == pytest.approx({"ttft_factor": 1.2, "tpot_factor": 1.2})


def test_the_served_factor_scales_the_decode_step_and_its_serving_work_alone(tmp_path):
    from pdserve.cli.sim import calibrated_costs

    roles = {"decode": {"stream_points": [[1, 0.001], [4, 0.002]], "reserve_s": 0.003}}
    prof = _profile(roles) | {"probe": {"factor": 1.0, "prefill_factor": 1.0, "decode_factor": 1.0}}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(prof))
    cont = {"factor": 1.1, "prefill_factor": 1.1, "decode_factor": 1.1}
    costs = calibrated_costs(str(path), cont, {"tpot_factor": 1.25})
    dec = costs["decode"]
    # a prompt step keeps the engine probe's factor; a decode step takes the served one
    assert dec.step.step_s([(0, 100)]) == pytest.approx(STEP.step_s([(0, 100)]) * 1.1)
    assert dec.step.step_s([(100, 1)]) == pytest.approx(STEP.step_s([(100, 1)]) * 1.25)
    # with the served TTFT factor too (--served-factors all), a prompt step takes it
    both = calibrated_costs(str(path), cont, {"ttft_factor": 1.5, "tpot_factor": 1.25})
    assert both["prefill"].step.step_s([(0, 100)]) == pytest.approx(STEP.step_s([(0, 100)]) * 1.5)
    assert [y for _, y in dec.stream_points] == pytest.approx([0.00125, 0.0025])
    assert costs["prefill"].stream_token_s == pytest.approx(0.00125)
    # the request path is left as profiled
    assert dec.reserve_s == 0.003
    plain = calibrated_costs(str(path), cont)
    assert plain["decode"].stream_points == ((1, 0.001), (4, 0.002))


def test_the_machine_load_over_a_window_in_fractions(tmp_path):
    from pdserve.sim.machine_load import cpu_times, load_between

    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 20 300 10 0 5 15 0 0\ncpu0 1 2 3\n")
    before = cpu_times(stat)
    assert before == {"user": 100, "nice": 0, "system": 20, "idle": 300, "iowait": 10,
                      "irq": 0, "softirq": 5, "steal": 15}  # fmt: skip
    stat.write_text("cpu  160 0 30 320 10 0 5 25 0 0\n")
    got = load_between(before, cpu_times(stat))
    assert got == pytest.approx({"busy": 0.7, "steal": 0.1, "idle": 0.2})
    assert cpu_times(tmp_path / "none") is None and load_between(None, before) is None


def test_the_simulator_counts_its_engine_seconds_apart_from_the_serving_work():
    # a 32-token prompt then 3 decodes, one stream: each step pays 1 ms of serving work on
    # top of its engine step (42 ms, then 10.032-10.034 ms)
    costs = CostModel(step=STEP, kv_bytes_per_token=100, stream_points=((1.0, 0.001),))
    cfg = InstanceConfig(num_blocks=256, block_size=16)
    spec = ClusterSpec([PoolSpec("colocated", 1, costs, cfg)], track_engine=True)
    cluster = SimCluster(spec)
    cluster.run([_req(0, 32, 4)])
    inst = cluster.instances["colocated-0"]
    assert inst.steps == 4 and inst.busy_s == pytest.approx(inst.engine_s + 4 * 0.001)
    assert cluster.engine_seconds() == {"colocated-0": inst.engine_s}
    assert (
        SimCluster(dataclasses.replace(spec, track_engine=False))
        .instances["colocated-0"]
        .track_engine
        is False
    )


def test_the_engine_speed_factors_are_the_real_engine_seconds_over_the_simulated_per_role():
    from pdserve.sim.validate import engine_speed_factors

    real = {"machine": {"engines": {
        "a1": {"role": "prefill", "step_seconds": 12.0},
        "b2": {"role": "decode", "step_seconds": 30.0},
        "c3": {"role": "", "step_seconds": 5.0},  # a role the run did not record: left out
    }}}  # fmt: skip
    got = engine_speed_factors(real, {"prefill-0": 10.0, "decode-0": 20.0, "decode-1": 10.0})
    assert got == pytest.approx({"prefill": 1.2, "decode": 1.0})
    assert engine_speed_factors({}, {"prefill-0": 1.0}) == {}


def test_a_prompt_step_after_a_pause_pays_the_cold_start_and_nothing_else_does():
    # a 32-token prompt is 42 ms; after >= 0.25 s without a step it is 47 ms
    costs = CostModel(step=STEP, kv_bytes_per_token=100, cold_prompt_s=0.005)
    cfg = InstanceConfig(num_blocks=256, block_size=16)
    spec = ClusterSpec([PoolSpec("colocated", 1, costs, cfg)], track_engine=True)

    def finishes(reqs: list[BenchRequest]) -> list[float]:
        return [r.finish_s for r in SimCluster(spec).run(reqs)]

    assert finishes([_req(0, 32, 1)]) == pytest.approx([0.047])  # the first step is cold
    # 53 ms after the last step: warm; a second later: cold again
    assert finishes([_req(0, 32, 1), _req(1, 32, 1, at=0.1)]) == pytest.approx([0.047, 0.142])
    assert finishes([_req(0, 32, 1), _req(1, 32, 1, at=1.0)]) == pytest.approx([0.047, 1.047])
    # decode steps never pay it, even after a pause: 47 ms, then 3 decodes of ~10.03 ms
    cluster = SimCluster(spec)
    (r,) = cluster.run([_req(0, 32, 4)])
    assert r.finish_s == pytest.approx(0.047 + 3 * 0.010 + 0.001 * 3, abs=2e-4)
    assert cluster.instances["colocated-0"].engine_s == pytest.approx(r.finish_s)  # engine time
    # it travels in a profile's costs and in the 1P1D prefill role
    from pdserve.sim.profile_pd import roles_of

    assert CostModel.from_json(costs.to_json()).cold_prompt_s == 0.005
    roles = roles_of({"prefill_factor": 1.2, "decode_factor": 1.0, "cold_prompt_s": 0.004})
    assert roles["prefill"]["cold_prompt_s"] == 0.004 and "cold_prompt_s" not in roles["decode"]


def test_an_arms_window_opens_after_its_warm_up_and_the_benchmark_runs_none(monkeypatch, tmp_path):
    """The window's engine seconds are compared with a simulation that has no warm-up, so the
    warm-up requests run before it opens, and the benchmark inside it sends none."""
    import pdserve.bench.cluster as cluster_mod
    import pdserve.bench.serve as serve_mod
    from pdserve.sim import validate

    calls: list[str] = []

    class FakeUp:
        tls_dir = None

        def __init__(self, *a, **kw) -> None:
            pass

        def __enter__(self) -> str:
            return "127.0.0.1:1"

        def __exit__(self, *exc) -> None:
            calls.append("down")

    class FakeWindow:
        @classmethod
        def open(cls, addr, tls_dir):
            calls.append("window open")
            return cls()

        def close(self):
            calls.append("window close")
            return {"engines": {}}

    def warm_up(addr, args):
        calls.append(f"warm-up {args.warmup}")

    def run_benchmark(addr, args):
        calls.append(f"benchmark, warm-up {args.warmup}")
        return {"summary": {}}

    monkeypatch.setattr(cluster_mod, "UpProcess", FakeUp)
    monkeypatch.setattr(serve_mod, "warm_up", warm_up)
    monkeypatch.setattr(serve_mod, "run_benchmark", run_benchmark)
    monkeypatch.setattr(validate, "ArmWindow", FakeWindow)
    args = argparse.Namespace(real=None, out=str(tmp_path / "v.json"), ready_timeout=5.0,
                              warmup=2, probe=False, profile=None, model=None)  # fmt: skip
    out = validate.real_results(args, {"c1": ["--mode", "colocated"]}, [])
    assert calls == ["warm-up 2", "window open", "benchmark, warm-up 0", "window close", "down"]
    assert out["c1"]["machine"] == {"engines": {}} and args.warmup == 2  # the caller's intact
