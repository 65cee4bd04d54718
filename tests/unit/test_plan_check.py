"""`plan_check`'s logic without a process: the goodput search over fake attainment curves,
the verdict and the spread, the ranks, and the `pdserve up` flags of each configuration
describing the cluster `plan` simulated."""

from __future__ import annotations

import itertools
import math

import pytest

from benchmarks.plan_check.configs import config_name, configurations, pick_of, up_flags
from benchmarks.plan_check.search import format_table, ranks, search_rate, verdict
from pdserve.sim.candidates import Budget, candidates
from pdserve.sim.run import spec_from_up_flags


def step_curve(threshold: float):
    """Attainment 1 up to `threshold` req/s, then 0.5: the goodput is `threshold`."""
    calls: list[float] = []

    def attain(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= threshold else 0.5

    return attain, calls


@pytest.mark.parametrize("start", [1.0, 9.0, 10.0, 10.5, 13.0, 40.0, 300.0])
@pytest.mark.parametrize("res", [0.1, 0.05])
def test_search_brackets_the_crossing_to_the_resolution(start, res):
    attain, calls = step_curve(10.0)
    s = search_rate(attain, start, 0.9, res, max_runs=30)
    assert s.goodput <= 10.0 < s.fail  # a passing rate below, a failing one above
    assert s.fail / s.goodput <= 1 + res + 1e-9
    assert [r for r, _ in s.points] == calls  # every visited point is recorded, in order
    assert s.goodput == max(r for r, a in s.points if a >= 0.9)


def test_a_search_that_agrees_with_its_start_costs_two_runs():
    attain, calls = step_curve(10.0)
    s = search_rate(attain, 10.0, 0.9, 0.1)
    assert calls == [10.0, pytest.approx(11.0)] and s.goodput == 10.0
    attain, calls = step_curve(10.0)
    s = search_rate(attain, 10.5, 0.9, 0.1)  # start fails, start / 1.1 passes
    assert calls == [10.5, pytest.approx(10.5 / 1.1)] and s.goodput == pytest.approx(10.5 / 1.1)


def test_steps_grow_geometrically_until_bracketed():
    attain, calls = step_curve(100.0)
    search_rate(attain, 10.0, 0.9, 0.1, max_runs=30)
    ups = calls[: next(i for i, r in enumerate(calls) if r > 100.0) + 1]
    ratios = [b / a for a, b in itertools.pairwise(ups)]
    # x 1.1, x 1.21, x 1.4641, ...: each step's exponent doubles
    assert ratios == pytest.approx([1.1 ** (2**i) for i in range(len(ratios))])


def test_nothing_passes_and_run_limit():
    s = search_rate(lambda r: 0.0, 8.0, 0.9, 0.1, min_rate=0.5)
    assert s.goodput == 0.0 and s.fail is not None and s.fail >= 0.5
    assert all(r >= 0.5 for r, _ in s.points)
    attain, calls = step_curve(1e9)
    s = search_rate(attain, 1.0, 0.9, 0.1, max_runs=5)
    assert len(calls) == 5 and s.fail is None and s.goodput == max(calls)
    with pytest.raises(ValueError, match="must be > 0"):
        search_rate(attain, 0.0)


def test_target_is_inclusive():
    s = search_rate(lambda r: 0.9 if r <= 5 else 0.89, 5.0, 0.9, 0.1)
    assert s.goodput == 5.0


def test_verdict_shortfall_and_spread():
    per_device = {"a": 20.0, "b": 18.5, "c": 10.0}
    v = verdict(per_device, "b")
    assert v.best == "a" and v.shortfall == pytest.approx(0.075) and v.within
    assert v.spread == pytest.approx(2.0) and v.spread_ok
    v = verdict(per_device, "c")
    assert v.shortfall == pytest.approx(0.5) and not v.within
    v = verdict({"a": 20.0, "b": 18.0}, "b")  # exactly 10 %: passes
    assert v.within and v.spread == pytest.approx(20 / 18) and not v.spread_ok
    v = verdict({"a": 20.0, "b": 0.0}, "a")  # a configuration passing at no rate
    assert v.spread is None and v.spread_ok and v.shortfall == 0.0
    with pytest.raises(ValueError, match="not among"):
        verdict(per_device, "z")


def test_ranks_share_ties():
    assert ranks({"a": 3.0, "b": 5.0, "c": 3.0, "d": 1.0}) == {"a": 2, "b": 1, "c": 2, "d": 4}


def test_table_names_pick_verdict_and_spread():
    rows = [
        {"config": "4 colocated", "devices": 4, "sim_goodput": 80.0, "sim_per_device": 20.0,
         "emu_goodput": 60.0, "emu_per_device": 15.0, "step_lag_max": 0.004},
        {"config": "3P1D", "devices": 4, "sim_goodput": 72.0, "sim_per_device": 18.0,
         "emu_goodput": 72.0, "emu_per_device": 18.0, "step_lag_max": None},
    ]  # fmt: skip
    v = verdict({r["config"]: r["emu_per_device"] for r in rows}, "4 colocated")
    text = format_table(rows, v)
    assert "within 16.7% of the emulated best (FAIL" in text
    assert "1.20x (TOO SMALL" in text and "0.40%" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("4 colocated"))
    assert line.endswith("<- plan") and " 1 " in line and " 2 " in line  # rank 1 sim, 2 emu


def test_configurations_fill_the_budget_and_their_flags_describe_the_same_cluster():
    budget = Budget.parse("h100:4")
    cands = candidates(budget, "llama3-8b", "nvlink", "bfloat16", [2048], [256], max_unit=4)
    units = [{"label": c.label, "goodput_req_s": 1.0 + i} for i, c in enumerate(cands)]
    configs = configurations(cands, units, budget, 8192)
    names = [c.name for c in configs]
    assert names == ["4 colocated", "2P2D (2 x 1P1D)", "1P2D", "1P3D", "2P1D", "3P1D"]
    assert [c.devices for c in configs] == [4, 4, 3, 4, 3, 4]
    costs = cands[0].costs["colocated"]
    for c in configs:
        twin = spec_from_up_flags(c.up, costs, 8192)
        assert "--no-kvstore" in c.up and twin.policy == c.spec.policy == "least_loaded"
        assert twin.kvstore_capacity_bytes is None
        for a, b in zip(c.spec.pools, twin.pools, strict=True):
            assert (a.role, a.count) == (b.role, b.count)
            for f in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs",
                      "chunked_prefill", "max_model_len"):  # fmt: skip
                assert getattr(a.config, f) == getattr(b.config, f), (c.name, f)
    res = {"best_overall": {"unit": cands[1].label, "replicas": 2}}
    assert pick_of(res, configs).name == "2P2D (2 x 1P1D)"
    with pytest.raises(ValueError, match="not a configuration"):
        pick_of({"best_overall": {"unit": "nope", "replicas": 1}}, configs)
    assert config_name(cands[0], 4) == "4 colocated"
    assert math.isclose(configs[0].unit_goodput, 1.0)


def test_a_decode_cap_other_than_the_prefill_pools_is_refused():
    budget = Budget.parse("h100:2")
    cands = candidates(budget, "llama3-8b", "nvlink", "bfloat16", [2048], [128], max_unit=2)
    disagg = next(c for c in cands if c.kind == "disagg")
    with pytest.raises(ValueError, match="engine shapes"):
        up_flags(disagg.spec(1, 8192))


def test_emulated_cluster_flags_name_the_planned_hardware_and_model(tmp_path):
    from benchmarks.evidence.emulated import EMULATE, EmuOptions
    from benchmarks.evidence.emulated import up_flags as emu_flags

    up = ["--mode", "colocated", "--colocated", "4"]
    default = emu_flags(up, EmuOptions(time_scale=10), tmp_path)
    assert default[4:8] == EMULATE and default[8:10] == ["--time-scale", "10"]
    opt = EmuOptions(time_scale=5, emulate=("--emulate", "a100", "--model-config", "opt-13b"))
    flags = emu_flags(up, opt, tmp_path)
    assert flags[:4] == up and flags[4:8] == ["--emulate", "a100", "--model-config", "opt-13b"]
    assert flags[-2:] == ["--log-dir", str(tmp_path)]


def test_heterogeneous_configurations_emulate_each_pools_hardware():
    from pdserve.costmodel.roofline import pool_costs
    from pdserve.sim.validate import flag_value

    budget = Budget.parse("h100:2,l40s:2")
    cands = candidates(budget, "llama3-8b", "nvlink", "bfloat16", [2048], [256], max_unit=2)
    units = [{"label": c.label, "goodput_req_s": 1.0} for c in cands]
    configs = configurations(cands, units, budget, 8192)
    names = [c.name for c in configs]
    assert len(set(names)) == len(names)
    assert {"2 colocated h100", "2 colocated l40s", "2P2D h100/l40s (2 x 1P1D)",
            "2P2D l40s/h100 (2 x 1P1D)"} <= set(names)  # fmt: skip
    het = next(c for c in configs if c.name == "2P2D h100/l40s (2 x 1P1D)")
    assert flag_value(het.up, "--emulate") == "prefill=h100,decode=l40s"
    assert not any("--num-blocks" in f for f in het.up)  # each worker's from its memory
    for c in configs:
        twin = spec_from_up_flags(c.up, pool_costs("llama3-8b", flag_value(c.up, "--emulate")),
                                  8192)  # fmt: skip
        for a, b in zip(c.spec.pools, twin.pools, strict=True):
            assert (a.role, a.count, a.costs.name) == (b.role, b.count, b.costs.name)
            assert a.config.num_blocks == b.config.num_blocks, c.name
