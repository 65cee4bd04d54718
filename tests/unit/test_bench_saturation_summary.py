"""`bench router-saturation`'s summary: per-unit costs net of the idle router, and the
per-repeat ratios of two arms (cost, and throughput for --replicas)."""

from __future__ import annotations

import pytest

from pdserve.bench.router_saturation import Arm, summarize
from pdserve.bench.stats_ci import ci95


def _arm(name: str, tokens: list[int], cpu: list[float], idle_rate: float) -> Arm:
    arm = Arm(name, None)
    arm.idle_cpu_s, arm.idle_s = idle_rate * 10.0, 10.0
    arm.samples[("streams", 8)] = [
        {"tokens": t, "messages": t, "window_s": 2.0, "router_cpu_s": c}
        for t, c in zip(tokens, cpu, strict=True)
    ]
    return arm


def test_costs_are_net_of_the_idle_router_and_ratios_are_per_repeat() -> None:
    one = _arm("1router", [1000, 1000], [0.12, 0.12], idle_rate=0.01)
    two = _arm("2routers", [2000, 1800], [0.24, 0.24], idle_rate=0.02)
    (row,) = summarize([one, two], [("streams", 8)])
    # (0.12 - 0.01 * 2 s) / 1000 tokens = 100 us
    assert row["1router"]["router_cpu_us_per_token"]["mean"] == pytest.approx(100.0)
    assert row["rate_ratio"]["mean"] == pytest.approx((2.0 + 1.8) / 2)
    assert row["rate_ratio"]["n"] == 2


def test_a_sample_with_no_unit_is_left_out_and_counted() -> None:
    one = _arm("a", [1000, 0], [0.1, 0.1], idle_rate=0.0)
    two = _arm("b", [1000, 1000], [0.1, 0.1], idle_rate=0.0)
    (row,) = summarize([one, two], [("streams", 8)])
    assert row["a"]["samples_left_out"] == 1
    assert row["rate_ratio"]["n"] == 1


def test_ci95_of_one_sample_has_no_interval() -> None:
    assert ci95([3.0]) == {"mean": 3.0, "ci95": None, "n": 1}
    lo, hi = ci95([1.0, 2.0, 3.0])["ci95"]
    assert lo < 2.0 < hi
