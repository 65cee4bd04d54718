"""The cost model before the CPU-host terms, from a profile and a `sim validate` run taken
with them, so that the same real run can be rescored with both (`sim validate --real`).

The earlier model: the profile's step fits refitted without the long-context samples
(`pdserve.sim.profile.sample_long_contexts`: decodes at >= 1,024 tokens of context, and mixed
steps whose decodes are that long), no per-role `neighbour_busy_factor`, and the probe's one
factor for both step kinds.

    python -m benchmarks.earlier_cost_model PROFILE VALIDATE_JSON OUT_PROFILE OUT_VALIDATE_JSON
    pdserve sim validate --real OUT_VALIDATE_JSON --profile OUT_PROFILE ...the run's flags...

With `--one-slope`, the profile terms just before the served-1P1D ones instead: every step
sample kept, fitted with one slope per token (no `token_knots`), one slope per stream (no
`stream_points`), the roles' neighbour factors kept but not the 1P1D request path nor the
disaggregated prompt's extra, and no probe of its own. (Until then the simulator also charged
the neighbour factor by the state at a step's start, not by overlap.)

With `--engine-fit-serving`, the profile terms just before the served worker's step counters:
the serving work per step and a served prompt's extra as differences against the engine-only
fit (no correction for the machine's speed in those minutes; the 1P1D prompt's against the
colocated prompts), the colocated worker's stream work for the 1P1D decode too, one neighbour
factor whatever the neighbour's batch, no Reserve round trip, and the probe after the engine's
steps only. (Until then the simulator also sent a 1-token request through a decode, as any
other.)
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Any

import numpy as np

from pdserve.costmodel.costs import StepCost

# the earlier profile's decodes stayed under 512 + 9 tokens of context; the long ones start
# at ~1,024
LONG_CONTEXT = 900


def is_long_context(sample: dict[str, Any]) -> bool:
    """A step that only `sample_long_contexts` records (batch: (start, new) per sequence)."""
    decodes = [start for start, new in sample["batch"] if new == 1]
    return sample["kind"] in ("decode", "mixed") and bool(decodes) and max(decodes) >= LONG_CONTEXT


def earlier_profile(prof: dict[str, Any]) -> dict[str, Any]:
    keep = [s for s in prof["engine"]["samples"] if not is_long_context(s)]
    batches, times = [s["batch"] for s in keep], [s["s"] for s in keep]
    out = dict(prof)
    out["costs"] = dict(prof["costs"]) | {"step": asdict(StepCost.fit(batches, times))}
    out["step_floor"] = asdict(StepCost.fit_floor(batches, times))
    out["roles"] = None
    return out


def one_slope_profile(prof: dict[str, Any]) -> dict[str, Any]:
    samples = prof["engine"]["samples"]
    batches, times = [s["batch"] for s in samples], [s["s"] for s in samples]
    out = dict(prof)
    costs = {k: v for k, v in prof["costs"].items() if k != "stream_points"}
    out["costs"] = costs | {"step": asdict(StepCost.fit(batches, times))}
    out["step_floor"] = asdict(StepCost.fit_floor(batches, times))
    out.pop("probe", None)  # the arm's probe against the floor fit, as it was
    roles = prof.get("roles") or {}
    out["roles"] = {
        r: {"neighbour_busy_factor": v["neighbour_busy_factor"]}
        for r, v in roles.items()
        if "neighbour_busy_factor" in v
    } or None
    return out


def engine_fit_serving_profile(prof: dict[str, Any]) -> dict[str, Any]:
    from pdserve.sim.profile_pd import disaggregated_prompt_extra, fit_served_prefill

    def against_fit(samples: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in p.items() if k != "served_step_s"} for p in samples]

    samples = prof["serving"]["samples"]
    x = np.array([p["streams"] for p in samples], dtype=float)
    y = np.array([p["tpot_s"] - p["engine_step_s"] for p in samples])
    rising = np.maximum.accumulate(np.maximum(y, 0.0))  # never negative nor falling
    points = [[float(b), float(v)] for b, v in zip(x, rising, strict=True)]
    prompts = against_fit(prof["serving"]["prefill_samples"])
    chunk_s, token_s = fit_served_prefill(prompts)
    out = dict(prof)
    out["costs"] = dict(prof["costs"]) | {
        "stream_points": points,
        "stream_token_s": max(0.0, float(x @ y / (x @ x))),
        "prefill_chunk_s": chunk_s,
        "prefill_token_s": token_s,
    }
    dropped = ("neighbour_points", "stream_points", "reserve_s")
    roles = {
        r: {k: v for k, v in terms.items() if k not in dropped}
        for r, terms in (prof.get("roles") or {}).items()
    }
    pd = prof.get("served_1p1d") or {}
    if "prefill" in roles and pd.get("idle_prompts"):
        pre_chunk, pre_token = disaggregated_prompt_extra(
            against_fit(pd["idle_prompts"]), 512, prompts, (chunk_s, token_s)
        )
        roles["prefill"] |= {"prefill_chunk_s": pre_chunk, "prefill_token_s": pre_token}
    out["roles"] = roles or None
    probe = prof.get("probe") or {}
    if "after_steps" in probe:  # the probe after the engine's steps only
        out["probe"] = probe["after_steps"]
    return out


def one_probe_factor(run: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(run))
    for arm in out["arms"].values():
        c = arm.get("contention")
        if c:
            c["prefill_factor"] = c["decode_factor"] = c["factor"]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.earlier_cost_model")
    p.add_argument("profile")
    p.add_argument("validate_json")
    p.add_argument("out_profile")
    p.add_argument("out_validate_json")
    p.add_argument("--one-slope", action="store_true",
                   help="the model before the piecewise token term and the served-1P1D terms")  # fmt: skip
    p.add_argument("--engine-fit-serving", action="store_true",
                   help="the model before the served worker's step counters")  # fmt: skip
    a = p.parse_args(argv)
    with open(a.profile) as f:
        prof = json.load(f)
    with open(a.validate_json) as f:
        run = json.load(f)
    if a.one_slope or a.engine_fit_serving:
        with open(a.out_profile, "w") as f:
            json.dump(
                one_slope_profile(prof) if a.one_slope else engine_fit_serving_profile(prof), f
            )
        with open(a.out_validate_json, "w") as f:
            json.dump(run, f)
        return 0
    old = earlier_profile(prof)
    kept = sum(not is_long_context(s) for s in prof["engine"]["samples"])
    print(f"{kept} of {len(prof['engine']['samples'])} step samples kept", file=sys.stderr)
    with open(a.out_profile, "w") as f:
        json.dump(old, f)
    with open(a.out_validate_json, "w") as f:
        json.dump(one_probe_factor(run), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
