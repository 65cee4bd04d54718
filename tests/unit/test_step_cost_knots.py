"""The step model's piecewise-linear token term (`StepCost.token_knots`), the knots a profile
picks (`knots_of`), the profile's engine thread, and what the served 1P1D profile adds to
each role (its request path and its prompt extra)."""

from __future__ import annotations

import threading

import pytest

from pdserve.costmodel.costs import CostModel, StepCost, knots_of, plan_features, token_ramps

# a CPU-like truth: 0.5 ms per token up to 64 tokens, 0.4 ms to 256, 0.8 ms beyond
TRUTH = StepCost(base_s=0.020, per_ctx_token_s=1e-6, per_attn_s=2e-7,
                 token_knots=(0, 64, 256), token_slopes=(5e-4, 4e-4, 8e-4))  # fmt: skip


def _samples() -> list[list[tuple[int, int]]]:
    prompts = [[(0, n)] for n in (16, 64, 128, 256, 384, 512) for _ in range(2)]
    chunked = [[(s, 512)] for s in (512, 1024, 1536)]
    decodes = [[(c, 1)] * b for c in (64, 512, 1024) for b in (1, 4, 16)]
    mixed = [[(0, 384)] + [(128, 1)] * b for b in (4, 16)]
    return prompts + chunked + decodes + mixed


def test_the_token_term_is_piecewise_linear_and_the_features_path_agrees():
    assert token_ramps(300, (0, 64, 256)).tolist() == [64, 192, 44]
    assert token_ramps(10, (0, 64, 256)).tolist() == [10, 0, 0]
    assert TRUTH.step_s([(0, 64)]) == pytest.approx(0.020 + 0.032 + 64e-6 + 2e-7 * 64 * 32.5)
    assert TRUTH.token_term_s(300) == pytest.approx(64 * 5e-4 + 192 * 4e-4 + 44 * 8e-4)
    for batch in _samples():
        assert TRUTH.features_s(plan_features(batch)) == pytest.approx(TRUTH.step_s(batch))
    # without knots: the one slope
    assert StepCost(per_token_s=1e-3).token_term_s(300) == pytest.approx(0.3)


def test_the_fit_recovers_a_piecewise_truth_a_single_slope_cannot():
    batches = _samples()
    times = [TRUTH.step_s(b) for b in batches]
    knots = knots_of(batches)
    assert knots[0] == 0.0 and 64.0 in knots and 256.0 in knots
    fit = StepCost.fit(batches, times, knots)
    assert fit.fit_rel_rmse < 1e-6
    for n in (8, 100, 300, 512, 700):
        assert fit.step_s([(0, n)]) == pytest.approx(TRUTH.step_s([(0, n)]), rel=1e-6)
    line = StepCost.fit(batches, times)
    assert line.fit_rel_rmse > 0.03  # the straight line misses the bend
    assert all(s >= 0 for s in fit.token_slopes)  # never decreasing in the tokens
    floor = StepCost.fit_floor(batches, times, token_knots=knots)
    assert floor.token_knots == knots
    with pytest.raises(ValueError, match="ascend from 0"):
        StepCost.fit(batches, times, (16, 64))


def test_knots_are_the_sampled_prompt_sizes_but_the_largest():
    batches = [[(0, n)] for n in (16, 64, 256, 512) for _ in range(2)]
    batches += [[(0, 999)]]  # seen once: not a knot
    batches += [[(64, 1)] * 4] * 3  # decodes only: not prompt sizes
    assert knots_of(batches) == (0.0, 16.0, 64.0, 256.0)
    many = [[(0, n)] for n in range(10, 400, 10) for _ in range(2)]
    assert len(knots_of(many, max_knots=5)) <= 5


def test_knots_survive_scaling_and_json():
    scaled = TRUTH.scaled(2.0)
    assert scaled.step_s([(0, 300)]) == pytest.approx(2 * TRUTH.step_s([(0, 300)]))
    back = CostModel.from_json(CostModel(step=TRUTH).to_json()).step
    assert back == TRUTH
    with pytest.raises(ValueError, match="differ in length"):
        StepCost(token_knots=(0, 64), token_slopes=(1e-3,))


def test_the_profile_steps_its_engine_off_the_main_thread():
    from pdserve.sim.engine_steps import on_engine_thread

    assert on_engine_thread(lambda: threading.current_thread().name) == "profile-engine"
    assert on_engine_thread(lambda a, b=0: a + b, 2, b=3) == 5
    with pytest.raises(KeyError, match="boom"):
        on_engine_thread(lambda: {}["boom"])


def test_the_served_1p1d_gives_the_roles_their_path_and_the_prefill_its_extra():
    from pdserve.sim.profile_pd import roles_of
    from pdserve.sim.run import costs_of_profile

    pd = {"prefill_factor": 1.2, "decode_factor": 1.1, "path_overhead_s": 0.009,
          "prefill_chunk_s": 0.004, "prefill_token_s": 1e-6}  # fmt: skip
    roles = roles_of(pd)
    assert roles["prefill"] == {"neighbour_busy_factor": 1.2, "prefill_chunk_s": 0.004,
                                "prefill_token_s": 1e-6, "router_overhead_s": 0.009}  # fmt: skip
    assert roles["decode"] == {"neighbour_busy_factor": 1.1, "router_overhead_s": 0.009}
    prof = {"costs": CostModel(step=TRUTH, router_overhead_s=0.005).to_json(), "roles": roles}
    costs = costs_of_profile(prof)
    assert costs["colocated"].router_overhead_s == 0.005  # one call: the colocated path
    assert costs["prefill"].router_overhead_s == costs["decode"].router_overhead_s == 0.009
    # the prefill role's prompt chunks pay the extra; a colocated one's do not
    assert costs["prefill"].step_time_s([(0, 100)], 0) == pytest.approx(
        TRUTH.step_s([(0, 100)]) + 0.004 + 1e-4
    )
    assert costs["colocated"].step_time_s([(0, 100)], 0) == pytest.approx(TRUTH.step_s([(0, 100)]))


def test_the_serving_work_of_a_step_follows_the_measured_stream_counts():
    from pdserve.costmodel.costs import interpolate

    pts = ((1.0, 0.0012), (4.0, 0.0017), (16.0, 0.0091))
    assert interpolate(1, pts) == pytest.approx(0.0012)
    assert interpolate(0.5, pts) == pytest.approx(0.0006)  # towards (0, 0)
    assert interpolate(10, pts) == pytest.approx(0.0017 + 6 * (0.0091 - 0.0017) / 12)
    assert interpolate(20, pts) == pytest.approx(0.0091 + 4 * (0.0091 - 0.0017) / 12)
    costs = CostModel(step=TRUTH, stream_token_s=0.00056, stream_points=pts)
    assert costs.stream_s(0) == 0.0
    assert costs.stream_s(4) == pytest.approx(0.0017)  # not 4 x 0.56 ms
    batch = [(500, 1)] * 4
    assert costs.step_time_s(batch, 4) == pytest.approx(TRUTH.step_s(batch) + 0.0017)
    assert costs.step_time_features_s(plan_features(batch), 4) == pytest.approx(
        costs.step_time_s(batch, 4)
    )
    assert CostModel(stream_token_s=0.00056).stream_s(4) == pytest.approx(0.00224)
    back = CostModel.from_json(costs.to_json())
    assert back.stream_points == pts and back.stream_s(10) == costs.stream_s(10)


def test_the_real_value_of_a_percentile_row_carries_its_bootstrap_interval():
    from pdserve.sim.validate import error_rows, real_ci95

    def run(tpots: list[float]) -> dict:
        recs = [{"ttft_s": 0.1, "tpot_s": t, "e2e_s": 1.0} for t in tpots]
        return {"sweep": [{"records": recs}],
                "summary": {"tpot_ms": {"p50": 1e3 * sorted(tpots)[len(tpots) // 2]}}}  # fmt: skip

    steady = run([0.020 + 0.0001 * (i % 5) for i in range(60)])
    lo, hi = real_ci95(steady, "TPOT p50 (ms)")
    assert 20.0 <= lo <= hi <= 20.4
    split = run([0.020] * 30 + [0.060] * 30)  # half beside a long prompt, half not
    lo, hi = real_ci95(split, "TPOT p50 (ms)")
    assert lo <= 20.0 + 1e-9 and hi >= 60.0 - 1e-9
    assert real_ci95(run([0.02] * 5), "TPOT p50 (ms)") is None  # too few requests
    assert real_ci95(steady, "prefill s/req") is None  # not a per-request percentile
    row = next(r for r in error_rows(split, split) if r["metric"] == "TPOT p50 (ms)")
    assert row["rel_error"] == 0.0 and len(row["real_ci95"]) == 2
