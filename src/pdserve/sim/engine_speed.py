"""An arm simulated again with each role's steps at its real engines' speed, read from the
workers' step counters (`validate.ArmWindow`).

Two uses, told apart by which counters they read:
- over the whole benchmark (`engine_matched_arm`): a diagnostic, not a prediction. What is
  left of the error is the serving model's, not the machine's speed during the run;
- over the benchmark's first `--calibrate-s` seconds (`live_calibrated_arm`): a prediction
  of the rest of the run, scored only on the requests that arrive after the window
  (`late_rows`), as a controller that watches live counters would make it. The run's
  withheld part never reaches the model.

On a shared host an engine's speed moves by 10-30 % between minutes while the probes taken
beside it read the machine unchanged (docs/studies/simulator-validation.md); the live window
measures the engines that serve, in the state they serve in.
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

from pdserve.sim.validate import engine_speed_factors, error_rows


def scaled_costs(costs: Any, factors: dict[str, float]) -> dict[str, Any]:
    """{role: `costs` (one CostModel, or one per role) with its step model x that role's
    factor}; a role without a factor keeps its steps."""
    from pdserve.costmodel.costs import KindScaledStep

    roles = costs if isinstance(costs, dict) else {r: costs for r in factors}
    out = {}
    for role, c in roles.items():
        out[role] = copy.copy(c)
        f = factors.get(role, 1.0)
        out[role].step = KindScaledStep(c.step, f, f)
    return out


def _simulate_scaled(
    costs: Any,
    factors: dict[str, float],
    flags: list[str],
    args: argparse.Namespace,
    max_len: int,
) -> dict[str, Any]:
    from pdserve.sim.run import simulate_benchmark, spec_from_up_flags

    spec = spec_from_up_flags(flags, scaled_costs(costs, factors), max_len, args.block_size)
    res = simulate_benchmark(spec, args)
    return {k: v for k, v in res.items() if not k.startswith("_")}


def engine_matched_arm(
    simulated: dict[str, Any],
    costs: Any,
    flags: list[str],
    args: argparse.Namespace,
    real: dict[str, Any],
    max_len: int,
) -> tuple[dict[str, float], list[dict[str, Any]]] | None:
    """The arm simulated once more with each role's step model x (the real workers' engine
    seconds / the engine seconds of the arm's simulation `simulated`, run with
    `track_engine`), over the whole benchmark; None when the real run recorded none.
    `max_len`: the arm's context limit (`cli.sim.max_model_len`)."""
    engines = (real.get("machine") or {}).get("engines") or {}
    if not any(e.get("role") for e in engines.values()):
        return None
    factors = engine_speed_factors(real, simulated["sweep"][0]["sim"]["engine_s"] or {})
    if not factors:
        return None
    return factors, error_rows(real, _simulate_scaled(costs, factors, flags, args, max_len))


def live_calibrated_arm(
    simulated: dict[str, Any],
    costs: Any,
    flags: list[str],
    args: argparse.Namespace,
    real: dict[str, Any],
    max_len: int,
) -> tuple[dict[str, float], list[dict[str, Any]], list[dict[str, Any]]] | None:
    """(each role's speed over the benchmark's first `early.after_s` seconds, the error rows
    of the arm simulated at that speed, the error rows of `simulated` itself), both scored
    on the requests that arrived after the window; None when the run has no early reading
    or the simulation no window (`ClusterSpec.engine_window_s`)."""
    early = (real.get("machine") or {}).get("early")
    window_s = (simulated["sweep"][0]["sim"] or {}).get("engine_s_window")
    if not early or not window_s:
        return None
    factors = engine_speed_factors(real, window_s, window="early")
    if not factors:
        return None
    after = float(early["after_s"])
    live = _simulate_scaled(costs, factors, flags, args, max_len)
    return factors, late_rows(real, live, after), late_rows(real, simulated, after)


def late_rows(real: dict[str, Any], sim: dict[str, Any], after_s: float) -> list[dict[str, Any]]:
    """`error_rows` over the requests of both runs that arrived at or after `after_s` (the
    percentile and stage rows; the goodput rows need a whole run and are left out)."""
    return error_rows(_late(real, after_s), _late(sim, after_s))


def _late(result: dict[str, Any], after_s: float) -> dict[str, Any]:
    """A run's result reduced to its requests that arrived at or after `after_s`: their
    summary and records (the rows' percentiles and bootstrap intervals)."""
    from pdserve.workload.metrics import RequestRecord, summarize

    kept = [r for r in result["sweep"][0]["records"] if r["arrival_s"] >= after_s]
    summary = summarize([RequestRecord.from_json(r) for r in kept])
    return {"summary": summary, "sweep": [{"records": kept}]}
