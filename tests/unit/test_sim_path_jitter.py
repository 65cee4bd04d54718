"""`sim validate --sim-draws`: each request's path overhead jittered per seed (ClusterSpec
path_jitter / path_seed), and the median of each metric over the draws (`median_rows`)."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.costmodel.costs import CostModel, StepCost
from pdserve.sim.cluster import ClusterSpec, PoolSpec, SimCluster
from pdserve.sim.instance import InstanceConfig
from pdserve.sim.validate import error_rows, median_rows
from pdserve.workload.requests import BenchRequest

OVERHEAD = 0.004
COSTS = CostModel(step=StepCost(base_s=0.010, per_token_s=0.001), router_overhead_s=OVERHEAD)


def _spec(**kw) -> ClusterSpec:
    pool = PoolSpec("colocated", 2, COSTS, InstanceConfig(num_blocks=256, block_size=16))
    return ClusterSpec([pool], policy="least_loaded", **kw)


def _ttfts(spec: ClusterSpec) -> list[float]:
    # far apart: nothing queues, so TTFT = path overhead + a 10 + 16 ms prefill step
    reqs = [
        BenchRequest(i, [100 + 50 * i + k for k in range(16)], 2, arrival_s=i) for i in range(20)
    ]
    return [r.ttft_s for r in SimCluster(spec).run(reqs)]


def test_no_jitter_charges_the_constant_overhead():
    assert _ttfts(_spec()) == pytest.approx([OVERHEAD + 0.026] * 20)


def test_jitter_draws_each_requests_overhead_within_the_band_per_seed():
    a = _ttfts(_spec(path_jitter=0.5, path_seed=1))
    assert a == _ttfts(_spec(path_jitter=0.5, path_seed=1))  # a seed is one draw, exactly
    b = _ttfts(_spec(path_jitter=0.5, path_seed=2))
    assert a != b
    for t in a + b:
        overhead = t - 0.026
        assert 0.5 * OVERHEAD - 1e-12 <= overhead <= 1.5 * OVERHEAD + 1e-12
    assert len({round(t, 9) for t in a}) > 10  # per request, not one draw per run
    assert dataclasses.replace(_spec(), path_jitter=0.0, path_seed=7) == _spec(path_seed=7)


def _result(ttft_p90: float, goodput: float) -> dict:
    return {
        "summary": {"ttft_ms": {"p50": 10.0, "p90": ttft_p90}, "stages": {"per_request": {}}},
        "goodput": {"vllm_req_s": goodput},
    }


def test_median_rows_take_the_median_sim_value_per_metric():
    real = _result(50.0, 10.0)
    draws = [error_rows(real, _result(p90, g)) for p90, g in ((60, 9), (52, 11), (49, 10.5))]
    rows = {r["metric"]: r for r in median_rows(draws)}
    assert rows["TTFT p90 (ms)"]["sim"] == 52 and rows["TTFT p90 (ms)"][
        "rel_error"
    ] == pytest.approx(0.04)
    assert rows["TTFT p90 (ms)"]["sim_draws"] == [60, 52, 49]
    assert rows["goodput vLLM (req/s)"]["sim"] == 10.5
    assert rows["TTFT p50 (ms)"]["rel_error"] == 0.0
    # what one side does not report stays unscored
    assert rows["TPOT p50 (ms)"]["sim"] is None and rows["TPOT p50 (ms)"]["rel_error"] is None
