"""The serving stack's cost per streamed token (`CostModel.stream_token_s`): charged per
sampled sequence per step by the simulated engine, so it lengthens TPOT (a delay of emit
times, `token_overhead_s`, cannot)."""

from __future__ import annotations

import random

import pytest

from pdserve.sim.costs import CostModel, StepCost, plan_features
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
