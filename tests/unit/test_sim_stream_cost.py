"""The serving stack's cost per streamed token (`CostModel.stream_token_s`): charged per
sampled sequence per step by the simulated engine, so it lengthens TPOT (a delay of emit
times, `token_overhead_s`, cannot)."""

from __future__ import annotations

import random

import pytest

from pdserve.costmodel.costs import CostModel, StepCost, plan_features
from pdserve.sim.instance import InstanceConfig, SimInstance


def _decode_step_s(stream_token_s: float, n: int = 4) -> float:
    costs = CostModel(step=StepCost(base_s=0.001, per_seq_s=1e-4), stream_token_s=stream_token_s)
    inst = SimInstance("i", 0, costs, InstanceConfig(num_blocks=64))
    for k in range(n):
        inst.add(f"r{k}", [5] * 10, max_tokens=8, prefill_only=False)
    plan, _prefill_s = inst.plan()  # the prompts (sample token 0)
    inst.finish_step(plan, _prefill_s)
    plan, decode_s = inst.plan()
    assert len(plan.scheduled) == n and all(e.sample for e in plan.scheduled)
    return decode_s


def test_stream_token_cost_is_charged_per_sampled_sequence_per_step():
    base = _decode_step_s(0.0)
    assert base == pytest.approx(0.001 + 4e-4)
    assert _decode_step_s(0.002) == pytest.approx(base + 4 * 0.002)
    costs = CostModel(stream_token_s=0.002)
    assert costs.step_time_s([], 3) == 0.0  # no step, no cost
    assert CostModel.from_json(costs.to_json()).stream_token_s == 0.002


class _Features(StepCost):
    """A step cost that records the features it is given."""

    def features_s(self, features):
        self.seen = features
        return 0.001


def test_a_steps_features_are_plan_features_of_its_entries_exactly():
    rng = random.Random(5)
    step = _Features()
    inst = SimInstance(
        "i", 0, CostModel(step=step), InstanceConfig(num_blocks=4096, max_num_batched_tokens=700)
    )
    for k in range(40):  # prompts of every length, chunked, then decodes beside chunks
        prompt = [rng.randint(5, 30000) for _ in range(rng.choice([1, 2, 17, 300, 1501]))]
        inst.add(f"r{k}", prompt, max_tokens=rng.randint(1, 30), prefill_only=False)
    steps = 0
    while inst.has_work():
        plan, _ = inst.plan()
        batch = [(e.start, e.num_new_tokens) for e in plan.scheduled]
        assert step.seen == plan_features(batch)  # the same floats, not approximately
        assert all(type(x) is float for x in step.seen)
        inst.finish_step(plan, 0.001)
        steps += 1
    assert steps > 20


def test_prefill_serving_cost_is_charged_per_chunk_and_prompt_token_on_both_paths():
    """`prefill_chunk_s` + `prefill_token_s` per token of every entry of more than one new
    token (a prompt chunk), nothing for decodes; the simulator's hot path charges the same."""
    step = StepCost(base_s=0.001, per_token_s=1e-5)
    plain = CostModel(step=step)
    served = CostModel(step=step, prefill_chunk_s=0.004, prefill_token_s=2e-5)
    batch = [(0, 100), (40, 1), (300, 20), (7, 1)]  # two chunks (120 tokens), two decodes
    extra = 2 * 0.004 + 120 * 2e-5
    assert served.step_time_s(batch, 4) == pytest.approx(plain.step_time_s(batch, 4) + extra)
    decodes = [(40, 1), (7, 1)]
    assert served.step_time_s(decodes, 2) == plain.step_time_s(decodes, 2)
    back = CostModel.from_json(served.to_json())
    assert (back.prefill_chunk_s, back.prefill_token_s) == (0.004, 2e-5)

    inst = SimInstance("i", 0, served, InstanceConfig(num_blocks=256))
    inst.add("a", [5] * 100, max_tokens=4, prefill_only=False)
    inst.add("b", [6] * 30, max_tokens=4, prefill_only=False)
    plan, dur = inst.plan()
    batch = [(e.start, e.num_new_tokens) for e in plan.scheduled]
    streamed = sum(1 for e in plan.scheduled if e.sample)
    assert dur == pytest.approx(served.step_time_s(batch, streamed))
    assert dur == pytest.approx(plain.step_time_s(batch, streamed) + 2 * 0.004 + 130 * 2e-5)


def test_fit_served_prefill_recovers_a_line_and_stays_non_negative():
    from pdserve.sim.profile import fit_served_prefill

    def samples(extra):
        return [
            {"tokens": n, "prefill_s": 0.01 + extra(n) + noise, "engine_step_s": 0.01}
            for n in (8, 32, 128, 256)
            for noise in (0.0, 0.0, 0.5)  # one stray slow sample per length: medians ignore it
        ]

    a, b = fit_served_prefill(samples(lambda n: 0.005 + 1e-4 * n))
    assert a == pytest.approx(0.005) and b == pytest.approx(1e-4)
    a, b = fit_served_prefill(samples(lambda n: 0.003 - 1e-6 * n))  # falling: a constant
    assert b == 0.0 and a == pytest.approx(0.003 - 1e-6 * 106, rel=1e-6)
    a, b = fit_served_prefill(samples(lambda n: -0.002 + 1e-4 * n))  # below 0 at 0: per token
    assert a == 0.0 and b > 0
    assert fit_served_prefill(samples(lambda n: -0.01)) == (0.0, 0.0)
