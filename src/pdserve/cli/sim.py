"""`pdserve sim run` / `pdserve sim validate`: the cluster simulator (pdserve.sim).

pdserve sim run --profile P.json --up "--mode colocated --colocated 2" --trace F --rate 1 ...
pdserve sim run --model-config llama3-8b --hardware h100 --up "--mode disagg --prefill 2 --decode 6" ...
pdserve sim validate --profile P.json --model M --trace F --rate 1 --duration 60 --arms ... --json
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any


def add_cost_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("costs (a measured profile, or a roofline)")
    g.add_argument("--profile", help="JSON from `pdserve profile` (this machine's costs)")
    g.add_argument(
        "--step-fit",
        choices=["typical", "floor"],
        default="typical",
        help="profile step model: typical (least squares on every step, contention included) "
        "or floor (lower envelope: the uncontended engine)",
    )
    g.add_argument("--model-config", help="config.json path or built-in name (roofline costs)")
    g.add_argument("--hardware", help="accelerator (roofline), e.g. h100; PREFILL_HW,DECODE_HW; "
                   "prefill=h100,decode=h100+l40s (costmodel.pools); sim validate without it: "
                   "each arm's --emulate")  # fmt: skip
    g.add_argument(
        "--network",
        default=None,
        help="KV link between pools (default: nvlink for a roofline, free for DistServe's)",
    )
    g.add_argument("--cost-model", default="roofline",
                   help="roofline (--model-config + --hardware), or distserve:FILE_OR_NAME[:ENGINE]: "
                   "DistServe's fitted step latencies (e.g. distserve:opt-13b:vllm), tensor "
                   "parallel per pool from --hardware (a100x2,a100)")  # fmt: skip
    g.add_argument("--dtype", default="bfloat16", help="roofline serving dtype (weights)")
    g.add_argument("--kv-dtype", default=None, choices=["bfloat16", "float16", "fp8", "int8"],
                   help="roofline KV cache dtype (default: --dtype)")  # fmt: skip


def add_parser(subparsers: Any) -> None:
    from pdserve.workload.spec import add_workload_args

    p = subparsers.add_parser("sim", help="cluster simulator calibrated on profiles")
    sub = p.add_subparsers(dest="sim_command", required=True)

    r = sub.add_parser("run", help="simulate `bench serve` on a cluster given by `up` flags")
    r.add_argument("--up", default="--mode disagg --prefill 1 --decode 1",
                   help="`pdserve up` flags of the simulated cluster")  # fmt: skip
    r.add_argument("--out", default="results/sim.json")
    r.add_argument("--plots", help="plot directory (default: next to --out)")
    add_cost_args(r)
    add_workload_args(r)
    r.set_defaults(func=run_main)

    v = sub.add_parser("validate", help="each arm for real and simulated: the error table")
    v.add_argument("--arms", default="colocated,disagg", help="as `bench compare --arms`")
    v.add_argument("--up-args", default="", help="extra flags for every `pdserve up`")
    v.add_argument("--ready-timeout", type=float, default=600.0)
    v.add_argument("--real", help="a saved `bench compare`/validate JSON instead of running")
    v.add_argument("--out", default="results/validate.json")
    v.add_argument("--json", action="store_true", help="print one JSON object")
    v.add_argument(
        "--probe",
        action="store_true",
        help="measure the machine's contention before/after each real arm (pdserve.sim.probe) "
        "and simulate with the profile's floor step model x that factor",
    )
    v.add_argument(
        "--served-factors",
        choices=("decode", "all", "off"),
        default="off",
        help="with --probe: the served probe's readings (sim.served_probe, on each arm's idle "
        "cluster against the profile's; always recorded) scale the prompt steps (its TTFT) "
        "and the decode steps and their serving work (its TPOT): all; the decode steps alone: "
        "decode; off (the default: over four rounds of three traces it did not help): the "
        "engine probe's factors alone",
    )
    v.add_argument(
        "--sim-draws",
        type=int,
        default=1,
        help="simulate each arm this many times, each request's path overhead jittered by "
        "--path-jitter with seeds 0..K-1, and compare the median of each metric over the draws "
        "(a tail percentile is one draw of a chaotic placement; see SIMULATOR.md)",
    )
    v.add_argument(
        "--path-jitter",
        type=float,
        default=1.0,
        help="with --sim-draws > 1: each request's path overhead x U(1 - J, 1 + J), 0 <= J <= 1",
    )
    add_cost_args(v)
    add_workload_args(v)
    v.set_defaults(func=validate_main)


def max_model_len(args: argparse.Namespace, default: int = 4096) -> int:
    if getattr(args, "max_model_len", None):
        return int(args.max_model_len)
    if getattr(args, "model", None):
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        return int(cfg.get("max_position_embeddings", default))
    return default


def costs_from_args(args: argparse.Namespace) -> Any:
    """A CostModel (or one per role) from --profile, or from --model-config + --hardware."""
    from pdserve.costmodel.costs import StepCost

    if args.profile:
        from pdserve.sim.run import costs_of_profile, load_profile

        prof = load_profile(args.profile)
        costs = costs_of_profile(prof)
        if args.step_fit == "floor" and prof.get("step_floor"):
            fields = StepCost.__dataclass_fields__
            floor = StepCost(**{k: v for k, v in prof["step_floor"].items() if k in fields})
            for c in costs.values() if isinstance(costs, dict) else [costs]:
                c.step = floor
        return costs
    if args.cost_model != "roofline":
        return distserve_pool_costs(args)
    if args.model_config and args.hardware:
        from pdserve.costmodel.roofline import pool_costs

        return pool_costs(
            args.model_config, args.hardware, args.network or "nvlink", args.dtype, None,
            args.kv_dtype,
        )  # fmt: skip
    raise SystemExit("pdserve sim: give --profile, or --model-config and --hardware")


def distserve_pool_costs(args: argparse.Namespace) -> Any:
    """Per-role costs from DistServe's coefficients (`--cost-model distserve:...`)."""
    from pdserve.costmodel.distserve import distserve_costs, load_distserve, parse_cost_model
    from pdserve.costmodel.hardware import split_hardware

    try:
        name, engine = parse_cost_model(args.cost_model)
        gpu = load_distserve(name)["gpu"]
        parts = [split_hardware(p) for p in (args.hardware or gpu).split(",") if p.strip()]
        if any(hw != gpu for hw, _ in parts):
            raise ValueError(f"--hardware {args.hardware!r}: the coefficients are for {gpu}")
        pre, dec = (distserve_costs(name, engine, tp, args.network)
                    for tp in (parts[0][1], parts[-1][1]))  # fmt: skip
    except ValueError as exc:
        raise SystemExit(f"pdserve sim: {exc}") from None
    return {"prefill": pre, "decode": dec, "colocated": pre}


def calibrated_costs(
    profile: str, contention: dict[str, float], served: dict[str, float] | None = None
) -> Any:
    """The profile's costs (per role when it measured roles) with its step model x the
    contention factor of each step kind (`validate.contention`). A profile that probed the
    machine itself (`probe`) keeps its typical fit, scaled by the arm's probe over its own:
    how much faster or slower the machine runs now than when it was profiled. An older one
    scales its floor (uncontended) fit by the arm's probe alone."""
    import copy

    from pdserve.costmodel.costs import KindScaledStep, StepCost
    from pdserve.sim.run import costs_of_profile, load_profile

    prof = load_profile(profile)
    fields = StepCost.__dataclass_fields__
    one = contention["factor"]
    factors = [contention.get(k, one) for k in ("prefill_factor", "decode_factor")]
    base = prof.get("probe")
    if base:
        fit = prof["costs"]["step"]
        factors = [f / base.get(k, base["factor"])
                   for f, k in zip(factors, ("prefill_factor", "decode_factor"), strict=True)]  # fmt: skip
    else:
        fit = prof.get("step_floor") or prof["costs"]["step"]
    if served and base:  # the served stack's own reading replaces the engine probe's
        factors[1] = served["tpot_factor"]
        if "ttft_factor" in served:
            factors[0] = served["ttft_factor"]
    step = KindScaledStep(StepCost(**{k: v for k, v in fit.items() if k in fields}), *factors)
    costs = costs_of_profile(prof)
    roles = costs if isinstance(costs, dict) else {"": costs}
    roles = {role: copy.copy(c) for role, c in roles.items()}
    for c in roles.values():
        c.step = step
        if served and base:
            served_scaled(c, served)
    return roles if isinstance(costs, dict) else roles[""]


def served_scaled(c: Any, served: dict[str, float]) -> None:
    """`c`'s serving work per decode step x the served probe's TPOT factor."""
    t = served["tpot_factor"]
    c.stream_token_s *= t
    c.stream_points = tuple((x, y * t) for x, y in c.stream_points)


def served_factors_of(
    args: argparse.Namespace, real: dict[str, Any], flags: list[str]
) -> dict[str, float] | None:
    """The arm's served probe over its profile's, from the profile's cluster of the same
    shape (a colocated worker, or the served 1P1D), as --served-factors picks them; None
    without both readings."""
    from pdserve.sim.served_probe import served_factors
    from pdserve.sim.validate import flag_value

    use = getattr(args, "served_factors", "off")
    if use == "off":
        return None
    prof = json.loads(Path(args.profile).read_text())
    part = "serving" if flag_value(flags, "--mode") != "disagg" else "served_1p1d"
    ref = (prof.get(part) or {}).get("served_probe")
    now = real.get("served_probe")
    if not ref or not now:
        return None
    factors = served_factors(ref, now["before"], now["after"])
    return factors if use == "all" else {"tpot_factor": factors["tpot_factor"]}


def engine_matched_arm(
    simulated: dict[str, Any],
    costs: Any,
    flags: list[str],
    args: argparse.Namespace,
    real: dict[str, Any],
) -> tuple[dict[str, float], list[dict[str, Any]]] | None:
    """The arm simulated once more with each role's step model x (the real workers' engine
    seconds / the engine seconds of the arm's simulation `simulated`, run with
    `track_engine`: `validate.engine_speed_factors`), from the run's step counters; None
    when the real run recorded none. It separates the machine's speed during the run, which
    no probe taken beside it predicts, from the model of the serving system."""
    import copy

    from pdserve.costmodel.costs import KindScaledStep
    from pdserve.sim.run import simulate_benchmark, spec_from_up_flags
    from pdserve.sim.validate import engine_speed_factors, error_rows

    engines = (real.get("machine") or {}).get("engines") or {}
    if not any(e.get("role") for e in engines.values()):
        return None
    factors = engine_speed_factors(real, simulated["sweep"][0]["sim"]["engine_s"] or {})
    if not factors:
        return None
    roles = costs if isinstance(costs, dict) else {r: costs for r in factors}
    scaled = {}
    for role, c in roles.items():
        scaled[role] = copy.copy(c)
        f = factors.get(role, 1.0)
        scaled[role].step = KindScaledStep(c.step, f, f)
    spec = spec_from_up_flags(flags, scaled, max_model_len(args), args.block_size)
    res = simulate_benchmark(spec, args)
    return factors, error_rows(real, {k: v for k, v in res.items() if not k.startswith("_")})


def _defaults_from_costs(args: argparse.Namespace, costs: Any) -> None:
    """Roofline runs have no checkpoint: vocab/context come from the model config."""
    if args.model or args.vocab_size:
        return
    model = args.model_config
    if not model and args.cost_model.startswith("distserve:"):
        from pdserve.costmodel.distserve import load_distserve, parse_cost_model

        model = load_distserve(parse_cost_model(args.cost_model)[0])["model"]
    if model:
        from pdserve.costmodel.shapes import load_model_config

        m = load_model_config(model)
        args.vocab_size = m.vocab_size
        args.max_model_len = args.max_model_len or m.max_position_embeddings


def run_main(args: argparse.Namespace) -> int:
    from pdserve.bench.report import format_summary
    from pdserve.bench.serve import save_result
    from pdserve.sim.run import simulate_benchmark, spec_from_up_flags

    costs = costs_from_args(args)
    _defaults_from_costs(args, costs)
    spec = spec_from_up_flags(shlex.split(args.up), costs, max_model_len(args), args.block_size)
    try:
        result = simulate_benchmark(spec, args)
    except ValueError as exc:
        raise SystemExit(f"pdserve sim run: {exc}") from None
    paths = save_result(result, args.out, args.plots)
    g = result["goodput"]
    print(f"simulated cluster: {spec.describe()}")
    print(format_summary(result["summary"], {
        "vLLM (req/s meeting all SLOs)": g["vllm_req_s"],
        "DistServe (max rate >= target)": (g["distserve"] or {}).get("interpolated"),
    }))  # fmt: skip
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _simulate_arm(
    spec: Any, args: argparse.Namespace, real: dict[str, Any]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """One arm simulated (`--sim-draws` times with a jittered request path): the first
    draw's result (with every draw's rows under "draws") and the error rows of the median
    over the draws."""
    import dataclasses

    from pdserve.sim.run import simulate_benchmark
    from pdserve.sim.validate import error_rows, median_rows

    if not 0.0 <= args.path_jitter <= 1.0:
        raise SystemExit("pdserve sim validate: --path-jitter must be within [0, 1]")
    draws = max(1, args.sim_draws)
    results, rows = [], []
    for seed in range(draws):
        if draws > 1:
            spec = dataclasses.replace(spec, path_jitter=args.path_jitter, path_seed=seed)
        res = simulate_benchmark(spec, args)
        results.append({k: v for k, v in res.items() if not k.startswith("_")})
        rows.append(error_rows(real, results[-1]))
    first = results[0]
    if draws == 1:
        return first, rows[0]
    first["draws"] = rows
    return first, median_rows(rows)


def validate_main(args: argparse.Namespace) -> int:
    import dataclasses

    from pdserve.bench.compare import parse_arms
    from pdserve.bench.report import write_json
    from pdserve.sim.run import spec_from_up_flags
    from pdserve.sim.validate import (
        flag_value,
        format_table,
        max_rel_error,
        real_results,
        with_router_overhead,
    )

    try:
        arms = parse_arms(args.arms)
    except ValueError as exc:
        raise SystemExit(f"pdserve sim validate: {exc}") from None
    extra = shlex.split(args.up_args) + (["--model", args.model] if args.model else [])
    # without --hardware (or --profile), each arm is simulated on the hardware it emulates
    per_arm = not (args.profile or args.hardware) and bool(args.model_config)
    costs = None if per_arm else costs_from_args(args)
    for name, flags in arms.items():
        if per_arm and not flag_value(flags + extra, "--emulate"):
            raise SystemExit(f"pdserve sim validate: arm {name} emulates no hardware; "
                             "give --hardware")  # fmt: skip
    _defaults_from_costs(args, costs)
    real = real_results(args, arms, extra)
    sim: dict[str, Any] = {}
    table: dict[str, list[dict[str, Any]]] = {}
    raw_table: dict[str, list[dict[str, Any]]] = {}
    matched_table: dict[str, list[dict[str, Any]]] = {}
    for name, flags in arms.items():
        arm_costs = costs
        if arm_costs is None:
            from pdserve.costmodel.roofline import pool_costs

            arm_costs = pool_costs(args.model_config, flag_value(flags + extra, "--emulate"),
                                   args.network or "nvlink", args.dtype, None, args.kv_dtype)  # fmt: skip
        if real[name].get("path_overhead_s") is not None:  # measured on the emulated cluster
            arm_costs = with_router_overhead(arm_costs, real[name]["path_overhead_s"])
        # every simulation counts its engine seconds, for the engine-speed diagnostic
        spec = spec_from_up_flags(flags + extra, arm_costs, max_model_len(args), args.block_size)
        spec = dataclasses.replace(spec, track_engine=True)
        sim[name], table[name] = _simulate_arm(spec, args, real[name])
        cont = real[name].get("contention")
        if cont and args.profile:
            raw_table[name] = table[name]  # the uncalibrated profile, kept for the record
            served = served_factors_of(args, real[name], flags + extra)
            cal = calibrated_costs(args.profile, cont, served)
            spec = spec_from_up_flags(flags + extra, cal, max_model_len(args), args.block_size)
            spec = dataclasses.replace(spec, track_engine=True)
            sim[name], table[name] = _simulate_arm(spec, args, real[name])
            sim[name]["contention_factor"] = cont["factor"]
            sim[name]["contention_factors"] = {
                k: cont.get(k, cont["factor"]) for k in ("prefill_factor", "decode_factor")
            }
            if served:
                sim[name]["served_factors"] = served
            arm_costs = cal
        matched = engine_matched_arm(sim[name], arm_costs, flags + extra, args, real[name])
        if matched is not None:
            sim[name]["engine_speed"], matched_table[name] = matched
    out = {
        "config": {k: v for k, v in vars(args).items() if k != "func"},
        "arms": real,
        "sim": sim,
        "errors": table,
        "max_rel_error": max_rel_error(table),
        "errors_uncalibrated": raw_table or None,
        "max_rel_error_uncalibrated": max_rel_error(raw_table) if raw_table else None,
        # a diagnostic, not a prediction: each role's steps x its real engines' speed in
        # the benchmark (the workers' step counters), so what is left is the serving model's
        "errors_engine_matched": matched_table or None,
    }
    path = write_json(args.out, out)
    if args.json:
        keys = ("errors", "max_rel_error", "errors_uncalibrated", "max_rel_error_uncalibrated",
                "errors_engine_matched")  # fmt: skip
        slim = {k: out[k] for k in keys} | {"out": str(path)}
        json.dump(slim, sys.stdout, indent=1)
        print()
    else:
        if raw_table:
            print("-- uncalibrated profile (--step-fit " + args.step_fit + "):")
            print(format_table(raw_table))
            print("-- floor step model x the contention factor measured around each arm:")
        print(format_table(table))
        m = out["max_rel_error"]
        print(f"max_rel_error {m:.1%}" if m is not None else "max_rel_error -")
        if matched_table:
            speeds = "; ".join(f"{arm}: " + ", ".join(f"{r} x{f:.3f}" for r, f in
                               sim[arm]["engine_speed"].items()) for arm in matched_table)  # fmt: skip
            print(f"-- a diagnostic: each role's steps x its engines' speed in the run ({speeds}):")
            print(format_table(matched_table))
        print(f"wrote {path}")
    return 0
