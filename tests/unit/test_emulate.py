"""The emulated engine (pdserve.emulate) in process: step durations follow the cost model
(a fake clock), tokens are a function of the whole context (continuations stay exact), KV
moves between two emulated engines and is checked, and the block count follows the modelled
device's memory."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.emulate.backend import EmulatedBackend, EmulateOptions, read_model_config
from pdserve.emulate.runner import KVMismatchError
from pdserve.emulate.tokens import token_for
from pdserve.emulate.worker import build_engine
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0
        self.slept: list[float] = []

    def now(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def _engine(clock=None, time_scale: float = 1.0, num_blocks: int = 512, **kw) -> LLMEngine:
    opts = EmulateOptions("h100", "llama3-8b", time_scale=time_scale)
    backend = EmulatedBackend(opts, read_model_config("llama3-8b", None), clock=clock)
    cfg = EngineConfig(model_dir="", num_blocks=num_blocks, max_num_batched_tokens=256, **kw)
    return LLMEngine(cfg, backend=backend)


def _prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 128_000, n).tolist()


def test_step_durations_follow_the_cost_model_with_a_fake_clock():
    clock = FakeClock()
    eng = _engine(clock, time_scale=3.0)
    costs = eng.backend.costs
    costs.stream_token_s = 0.0004  # a measured serving cost per stream per step, if any
    plans: list[list[tuple[int, int]]] = []
    sampled: list[int] = []
    orig = eng.scheduler.schedule

    def schedule():
        plan = orig()
        plans.append([(e.start, e.num_new_tokens) for e in plan.scheduled])
        sampled.append(sum(1 for e in plan.scheduled if e.sample))
        return plan

    eng.scheduler.schedule = schedule
    for i, n in enumerate((700, 40, 5)):  # a chunked prefill (budget 256), then decodes
        eng.add_request(f"r{i}", _prompt(n, i), GREEDY)
    durations = []
    while eng.has_unfinished_requests():
        t0 = clock.now()
        eng.step()
        durations.append(clock.now() - t0)
    assert len(durations) == len(plans) > 12
    cost = costs.step  # the H100 roofline of llama3-8b
    for batch, n, wall in zip(plans, sampled, durations, strict=True):
        assert wall == pytest.approx(3.0 * (cost.step_s(batch) + 0.0004 * n), rel=1e-9)
    assert sampled[0] == 0 and sampled[-1] == 3  # a prefill chunk samples nothing
    runner = eng.runner
    modelled = sum(costs.step_time_s(b, n) for b, n in zip(plans, sampled, strict=True))
    assert runner.modelled_s == pytest.approx(modelled)
    assert runner.lag_s == 0.0  # a fake clock never wakes late
    # the roofline's shape: a 256-token prefill chunk costs more than a 3-sequence decode
    assert cost.step_s([(0, 256)]) > cost.step_s([(100, 1)] * 3) > 0


def test_tokens_are_a_function_of_the_whole_context():
    eng = _engine()
    prompt = _prompt(100, 7)
    out = eng.generate([prompt], GREEDY)[0]
    ctx = list(prompt)
    for tok in out:  # token i = H(tokens 0..i-1, seed) below the modelled vocabulary
        assert tok == token_for(ctx, 0, 128256)
        ctx.append(tok)
    # a continuation (what a migration re-prefills elsewhere) draws the same remaining tokens
    other = _engine()
    rest = other.generate([prompt + out[:5]], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert rest == out[5:]
    # the seed is part of the hash
    seeded = eng.generate([prompt], SamplingParams(max_tokens=12, seed=3, ignore_eos=True))[0]
    assert seeded != out


def _prefill_then_decode(corrupt: bool = False) -> list[int]:
    pre, dec = _engine(), _engine()
    prompt = _prompt(50, 3)
    layers: dict[int, np.ndarray] = {}
    pre.add_request("x", prompt, GREEDY, prefill_only=True,
                    kv_sink=lambda layer, kv: layers.__setitem__(layer, kv))  # fmt: skip
    first = [t for outs in iter(pre.step, []) for o in outs for t in o.new_token_ids]
    assert len(first) == 1 and sorted(layers) == [0]
    kv = layers[0]
    assert kv.shape == (4, 2, 16, 1, 1) and kv.dtype == np.float16  # a few bytes per block
    if corrupt:
        kv = kv.copy()
        kv[1, 0, 3] += 1
    dec.reserve("x", len(prompt) + 1)
    dec.write_kv("x", 0, kv)
    assert dec.add_prefilled_request("x", prompt, first[0], GREEDY) is None
    out = list(first)
    while dec.has_unfinished_requests():
        for o in dec.step():
            out += o.new_token_ids
    return out


def test_kv_moves_between_emulated_engines_and_is_checked():
    colocated = _engine().generate([_prompt(50, 3)], GREEDY)[0]
    assert _prefill_then_decode() == colocated
    with pytest.raises(KVMismatchError, match="1 of 50 positions differ"):
        _prefill_then_decode(corrupt=True)


def test_blocks_follow_device_memory_minus_weights():
    llm, em = build_engine(EmulateOptions("h100", "llama3-8b"), None, EngineConfig(model_dir=""))
    shape = em.backend.shape
    expected = int((80e9 * 0.9 - shape.params * 2) // (shape.kv_bytes_per_token(2) * 16))
    assert llm.num_blocks == expected
    big, _ = build_engine(EmulateOptions("h200", "llama3-8b"), None, EngineConfig(model_dir=""))
    assert big.num_blocks > llm.num_blocks  # 141 GB vs 80 GB
    assert llm.spec.bytes_per_block == 64  # what actually moves per block
    # the link charges the modelled bytes: 2 MiB per block over NVLink
    assert em.push_link.bytes_ratio == shape.kv_bytes_per_token(2) * 16 / 64
    llm.check_integrity()


def test_time_lost_between_steps_of_a_busy_engine_is_counted_as_the_gap():
    clock = FakeClock()
    eng = _engine(clock, time_scale=2.0)
    runner = eng.runner
    eng.add_request("a", _prompt(40, 1), GREEDY)
    eng.step()  # prefill (samples token 0)
    eng.step()  # a decode chained on the previous deadline: no gap
    assert runner.gap_s == 0.0
    clock.t += 0.050  # the engine's thread starved for 50 ms of wall time
    eng.step()  # continues "a": the late start is time lost
    assert runner.gap_s == pytest.approx(0.050 / 2.0)
    clock.t += 0.0001  # under chain_gap_s (2 ms modelled): chained, nothing lost
    eng.step()
    assert runner.gap_s == pytest.approx(0.025)
    while eng.has_unfinished_requests():
        eng.step()
    clock.t += 5.0  # idle: no request ran in the step before
    eng.add_request("b", _prompt(30, 2), GREEDY)
    eng.step()
    assert runner.gap_s == pytest.approx(0.025)
    assert runner.counters()["emulate_gap_s"] == pytest.approx(0.025)
    assert runner.lag_s == 0.0  # the lag does not see any of it


def test_a_prompt_step_after_a_pause_pays_the_cold_start_as_the_simulator_charges_it():
    clock = FakeClock()
    eng = _engine(clock, time_scale=2.0)
    costs = eng.backend.costs
    costs.cold_prompt_s = 0.010  # a CPU profile's; the roofline's is 0

    def timed_step() -> tuple[float, float]:
        """One step's wall time and its model's (one sampled sequence), x the time scale."""
        from pdserve.sim.engine_steps import recorded_batches

        with recorded_batches(eng) as batches:
            t0 = clock.now()
            eng.step()
        return clock.now() - t0, 2.0 * costs.step_time_s(batches[0], 1)

    eng.add_request("a", _prompt(40, 1), GREEDY)
    wall, model = timed_step()  # the first step: cold
    assert wall == pytest.approx(model + 2.0 * 0.010)
    clock.t += 1.0  # a decode after a pause: never
    wall, model = timed_step()
    assert wall == pytest.approx(model)
    while eng.has_unfinished_requests():
        eng.step()
    eng.add_request("b", _prompt(30, 2), GREEDY)  # right after the last step: warm
    wall, model = timed_step()
    assert wall == pytest.approx(model)
    while eng.has_unfinished_requests():
        eng.step()
    clock.t += 0.5  # 0.25 s modelled: cold again
    eng.add_request("c", _prompt(30, 3), GREEDY)
    wall, model = timed_step()
    assert wall == pytest.approx(model + 2.0 * 0.010)
