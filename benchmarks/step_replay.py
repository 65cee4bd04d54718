"""Replay a workload through one real engine in virtual time and compare every step with a
profile's step model: where does the fitted `StepCost` miss, and on which steps?

The engine (`LLMEngine`, the worker's defaults: 512-token budget, 64 sequences, prefix
caching) is driven as one colocated worker would be: requests are added when the virtual
clock passes their arrival; each `step()` advances the clock by its measured time. `--clock
cpu` measures the engine thread's CPU time (`time.thread_time`), which a busy neighbour on a
shared machine inflates far less than wall time, so the step model's *form* can be checked
while other work runs; `--clock wall` is what a served run sees. Each step is compared with
the profile's prediction (`--step-fit typical|floor`), and the residuals are summarised by
step kind (prefill, chunk over a context, decode, mixed) and by context band.

    python -m benchmarks.step_replay --model DIR --profile P.json \
        --input-len lognormal:1024,0.6 --output-len uniform:8,32 --rate 1 --burstiness 0.3 \
        --duration 60 [--clock cpu] [--fit-out steps.json] --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import numpy as np


def step_kind(batch: list[tuple[int, int]]) -> str:
    dec = any(n == 1 for _, n in batch)
    pre = [(s, n) for s, n in batch if n > 1]
    if pre and dec:
        return "mixed"
    if pre:
        return "chunk" if any(s > 0 for s, _ in pre) else "prefill"
    return "decode"


def replay(engine: Any, reqs: list[Any], clock: str) -> list[dict[str, Any]]:
    """Drive `engine` through `reqs` (arrival_s, prompt_ids, max_tokens) in virtual time."""
    from pdserve.engine.params import SamplingParams
    from pdserve.sim.engine_steps import recorded_batches

    tick = time.thread_time if clock == "cpu" else time.perf_counter
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    now, i, out = 0.0, 0, []
    with recorded_batches(engine) as last:
        while i < len(pending) or engine.has_unfinished_requests():
            if not engine.has_unfinished_requests() and pending[i].arrival_s > now:
                now = pending[i].arrival_s  # idle: jump to the next arrival
            while i < len(pending) and pending[i].arrival_s <= now:
                r = pending[i]
                engine.add_request(
                    f"r{r.index}",
                    list(r.prompt_ids),
                    SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True),
                )
                i += 1
            t0 = tick()
            engine.step()
            dt = tick() - t0
            now += dt
            if last and last[-1]:
                out.append({"batch": last[-1], "s": dt, "at": now})
            last.clear()
    return out


def summarise(steps: list[dict[str, Any]], step_model: Any) -> dict[str, Any]:
    """Per kind: steps, measured seconds, predicted seconds, ratio of the sums, median ratio."""
    groups: dict[str, list[tuple[float, float]]] = {}
    for s in steps:
        batch = [tuple(x) for x in s["batch"]]
        pred = step_model.step_s(batch)
        ctx = max(a + n for a, n in batch)
        band = "ctx<512" if ctx < 512 else ("ctx<1536" if ctx < 1536 else "ctx>=1536")
        for key in (step_kind(batch), f"{step_kind(batch)} {band}", "all"):
            groups.setdefault(key, []).append((s["s"], pred))
    rows = {}
    for key, pts in sorted(groups.items()):
        meas, pred = sum(p[0] for p in pts), sum(p[1] for p in pts)
        rows[key] = {
            "steps": len(pts),
            "measured_s": meas,
            "predicted_s": pred,
            "measured_over_predicted": meas / pred if pred else None,
            "median_ratio": statistics.median(p[0] / max(p[1], 1e-9) for p in pts),
        }
    return rows


def main(argv: list[str] | None = None) -> int:
    from pdserve.workload.spec import add_workload_args, workload_at

    p = argparse.ArgumentParser(prog="python -m benchmarks.step_replay")
    add_workload_args(p)
    p.add_argument("--profile", required=True)
    p.add_argument("--step-fit", choices=["typical", "floor"], default="floor")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["cpu", "wall"], default="cpu")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--fit-out", help="write the replayed steps (batch, seconds) here")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    import torch

    from pdserve.costmodel.costs import StepCost
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    torch.set_num_threads(a.threads)
    prof = json.loads(open(a.profile).read())
    fields = StepCost.__dataclass_fields__
    src = prof.get("step_floor") if a.step_fit == "floor" else None
    model = StepCost(**{k: v for k, v in (src or prof["costs"]["step"]).items() if k in fields})
    engine = LLMEngine(
        EngineConfig(
            model_dir=a.model, dtype=a.dtype, max_num_batched_tokens=a.max_num_batched_tokens
        )
    )
    engine.generate([[11] * 64], None)  # warm-up
    reqs = workload_at(a, a.rate)
    steps = replay(engine, reqs, a.clock)
    rows = summarise(steps, model)
    if a.fit_out:
        with open(a.fit_out, "w") as f:
            json.dump({"clock": a.clock, "steps": steps}, f)
    x = [[tuple(b) for b in s["batch"]] for s in steps]
    refit = StepCost.fit(x, [s["s"] for s in steps])
    out = {"requests": len(reqs), "steps": len(steps), "by_kind": rows,
           "refit_on_replay": refit.__dict__, "profile_step": model.__dict__}  # fmt: skip
    if a.json:
        json.dump(out, sys.stdout, indent=1, default=float)
        print()
    else:
        for k, r in rows.items():
            print(f"{k:<22}{r['steps']:>6}{r['measured_s']:>10.3f}{r['predicted_s']:>10.3f}"
                  f"{r['measured_over_predicted']:>8.2f}{r['median_ratio']:>8.2f}")  # fmt: skip
    _ = np
    return 0


if __name__ == "__main__":
    sys.exit(main())
