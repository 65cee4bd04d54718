"""Contention probe: how much slower the real engine steps right now than its profile says.

This machine's cores are shared with other work whose load changes minute to minute, so a
profile taken earlier does not describe the steps of a benchmark run taken now. `pdserve sim
validate --probe` runs this probe (a subprocess pinned to one core, one torch thread, the
same checkpoint) just before and just after each real arm: a fixed set of prefill and decode
steps, each compared with the profile's *floor* (uncontended) step model. The median ratio of
each kind is the arm's contention factor for that kind (prompt steps are compute-bound, decode
steps memory-bound: a neighbour slows them differently); the simulator scales a step with a
prompt chunk by the prefill factor and a decode-only step by the decode factor
(`costmodel.costs.KindScaledStep`). It calibrates the machine's state, never the benchmark's
outcome: the probe sees no request of the run.

    python -m pdserve.sim.probe --model DIR --profile P.json [--cpu 0]  -> one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any


def run_probe(
    model: str, profile: str | None, dtype: str = "float32", cpu: int | None = 0
) -> dict[str, Any]:
    """The probe's steps, on an engine thread as the profile's and the worker's are."""
    from pdserve.sim.engine_steps import on_engine_thread

    return on_engine_thread(_probe_steps, model, profile, dtype, cpu)


def _probe_steps(model: str, profile: str | None, dtype: str, cpu: int | None) -> dict[str, Any]:
    import numpy as np
    import torch

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.params import SamplingParams
    from pdserve.sim.engine_steps import timed_steps

    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(model_dir=model, dtype=dtype, enable_prefix_caching=False))
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    # a short-context model takes the longest prompts it can (96 and 256 tokens otherwise)
    decode_len = min(96, engine.max_model_len - 12)
    prompt_len = min(256, engine.max_model_len - 1)
    kept: list[dict[str, Any]] = []
    for rep in range(3):
        for k in range(4):
            engine.add_request(
                f"q{rep}-{k}", rng.integers(10, engine.vocab_size, decode_len).tolist(), params
            )
        samples: list[dict[str, Any]] = []
        timed_steps(engine, samples, "probe")
        engine.add_request(f"p{rep}", rng.integers(10, engine.vocab_size, prompt_len).tolist(), one)
        timed_steps(engine, samples, "probe")
        kept += samples[1:] if rep == 0 else samples  # the first step warms up
    out: dict[str, Any] = {"samples": [{"batch": x["batch"], "s": x["s"]} for x in kept]}
    if profile is not None:
        out |= probe_factors(out["samples"], floor_of(json.loads(open(profile).read())))
    return out


def floor_of(prof: dict[str, Any]) -> Any:
    """A profile's floor (uncontended) step fit, its typical one when it has none."""
    from pdserve.costmodel.costs import StepCost

    fields = StepCost.__dataclass_fields__
    fit = prof.get("step_floor") or prof["costs"]["step"]
    return StepCost(**{k: v for k, v in fit.items() if k in fields})


def probe_factors(samples: list[dict[str, Any]], floor: Any) -> dict[str, Any]:
    """Each probe step's time over the floor fit's: the median per step kind (a step with a
    prompt chunk is a prefill step) and over all."""
    import numpy as np

    ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
    for x in samples:
        kind = "prefill" if any(n > 1 for _, n in x["batch"]) else "decode"
        ratios[kind].append(x["s"] / max(floor.step_s(x["batch"]), 1e-6))
    every = ratios["prefill"] + ratios["decode"]
    return {
        "factor": statistics.median(every),  # one factor for every step (the older probe)
        "prefill_factor": statistics.median(ratios["prefill"]),
        "decode_factor": statistics.median(ratios["decode"]),
        "steps": len(every),
        "p10": float(np.percentile(every, 10)),
        "p90": float(np.percentile(every, 90)),
    }


def probe_subprocess(
    model: str, profile: str | None, dtype: str = "float32", cpu: int = 0
) -> dict[str, Any]:
    """The probe in a process of its own; without a profile, its steps only (`samples`)."""
    argv = [sys.executable, "-m", "pdserve.sim.probe", "--model", model, "--dtype", dtype,
            "--cpu", str(cpu)] + (["--profile", profile] if profile else [])  # fmt: skip
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.sim.probe")
    p.add_argument("--model", required=True)
    p.add_argument("--profile", default=None, help="without one: the steps, no factors")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--cpu", type=int, default=0)
    a = p.parse_args(argv)
    print(json.dumps(run_probe(a.model, a.profile, a.dtype, a.cpu)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
