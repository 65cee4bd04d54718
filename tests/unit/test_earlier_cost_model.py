"""benchmarks.earlier_cost_model: the cost model before the CPU-host terms, for rescoring."""

from __future__ import annotations

import pytest

from benchmarks.earlier_cost_model import earlier_profile, is_long_context, one_probe_factor
from pdserve.costmodel.costs import StepCost


def _sample(kind: str, batch: list[tuple[int, int]]) -> dict:
    step = StepCost(base_s=0.02, per_token_s=5e-4, per_ctx_token_s=1e-6, per_attn_s=2e-7)
    return {"kind": kind, "batch": batch, "s": step.step_s(batch)}


def test_long_context_samples_are_the_ones_dropped() -> None:
    short = [_sample("prefill", [(0, n)]) for n in (16, 64, 256, 512)] + [
        _sample("decode", [(c + k, 1)] * b) for c in (64, 512) for b in (1, 4) for k in (0, 8)
    ]
    short += [_sample("mixed", [(128, 1), (128, 1), (0, 384)])]
    long = [_sample("decode", [(2048, 1)] * 4), _sample("mixed", [(1030, 1), (512, 488)])]
    assert not any(map(is_long_context, short))
    assert all(map(is_long_context, long))
    prof = {
        "engine": {"samples": short + long},
        "costs": {"step": {}, "stream_token_s": 1e-3},
        "step_floor": {},
        "roles": {"prefill": {"neighbour_busy_factor": 1.2}},
    }
    old = earlier_profile(prof)
    assert old["roles"] is None
    assert old["costs"]["stream_token_s"] == 1e-3  # the other terms are kept
    assert old["costs"]["step"]["per_token_s"] > 0
    assert prof["roles"] is not None  # the input is not changed


def test_one_probe_factor_for_both_kinds() -> None:
    run = {"arms": {"c1": {"contention": {"factor": 1.1, "prefill_factor": 0.9,
                                          "decode_factor": 1.3}}, "d11": {}}}  # fmt: skip
    out = one_probe_factor(run)
    c = out["arms"]["c1"]["contention"]
    assert c["prefill_factor"] == c["decode_factor"] == 1.1
    assert run["arms"]["c1"]["contention"]["prefill_factor"] == 0.9


def test_one_slope_drops_the_knots_and_the_1p1d_terms_but_keeps_the_factors() -> None:
    from benchmarks.earlier_cost_model import one_slope_profile

    samples = [_sample("prefill", [(0, n)]) for n in (16, 64, 256, 512) for _ in range(2)]
    samples += [_sample("decode", [(c, 1)] * b) for c in (64, 512) for b in (1, 4)]
    roles = {"prefill": {"neighbour_busy_factor": 1.2, "prefill_chunk_s": 0.01,
                         "router_overhead_s": 0.009},
             "decode": {"neighbour_busy_factor": 1.1, "router_overhead_s": 0.009}}  # fmt: skip
    prof = {"engine": {"samples": samples},
            "costs": {"step": {"token_knots": [0, 64]}, "stream_points": [[1, 0.001]]},
            "step_floor": {}, "roles": roles, "probe": {"factor": 0.9}}  # fmt: skip
    old = one_slope_profile(prof)
    assert old["costs"]["step"]["token_knots"] == ()
    assert "stream_points" not in old["costs"] and "probe" not in old
    assert old["costs"]["step"]["per_token_s"] > 0
    assert old["roles"] == {"prefill": {"neighbour_busy_factor": 1.2},
                            "decode": {"neighbour_busy_factor": 1.1}}  # fmt: skip
    assert prof["roles"]["prefill"]["router_overhead_s"] == 0.009  # the input is not changed


def test_engine_fit_serving_takes_the_serving_work_against_the_fit_and_drops_the_newer_terms() -> (
    None
):
    from benchmarks.earlier_cost_model import engine_fit_serving_profile

    samples = [{"streams": 1, "tpot_s": 0.022, "engine_step_s": 0.020, "served_step_s": 0.021},
               {"streams": 4, "tpot_s": 0.025, "engine_step_s": 0.026, "served_step_s": 0.026}]  # fmt: skip
    prof = {
        "costs": {"stream_points": [[1.0, 0.0], [4.0, 0.0]], "stream_token_s": 0.0},
        "serving": {"samples": samples, "prefill_samples": [
            {"tokens": n, "prefill_s": 0.030 + 0.001 * n, "engine_step_s": 0.020 + 0.001 * n,
             "served_step_s": 0.030 + 0.001 * n} for n in (8, 32, 128)]},
        "probe": {"factor": 0.95, "after_steps": {"factor": 0.9}},
        "roles": {
            "prefill": {"neighbour_busy_factor": 1.2, "neighbour_points": [[1.0, 1.1], [4.0, 1.2]]},
            "decode": {"neighbour_busy_factor": 1.3, "stream_points": [[1.0, 0.0]],
                       "reserve_s": 0.002, "router_overhead_s": 0.008},
        },
    }  # fmt: skip
    out = engine_fit_serving_profile(prof)
    # 2 ms over the fit at 1 stream, -1 ms at 4: never negative nor falling
    assert out["costs"]["stream_points"] == [
        [1.0, pytest.approx(0.002)],
        [4.0, pytest.approx(0.002)],
    ]
    assert out["roles"] == {"prefill": {"neighbour_busy_factor": 1.2},
                            "decode": {"neighbour_busy_factor": 1.3, "router_overhead_s": 0.008}}  # fmt: skip
    assert prof["roles"]["decode"]["reserve_s"] == 0.002  # the input is left as it was
    # a prompt's extra against the fit (10 ms), not its own steps (0); the older probe
    assert out["costs"]["prefill_chunk_s"] == pytest.approx(0.010)
    assert out["costs"]["prefill_token_s"] == pytest.approx(0.0, abs=1e-9)
    assert out["probe"] == {"factor": 0.9}
