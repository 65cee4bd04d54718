"""`pdserve sim validate`: the same arms and workload as `bench compare`, run for real on this
machine and in simulation; the error table says how far the simulator is from the measurement.

Relative error = |sim - real| / |real| per metric and arm; `max_rel_error` is the largest over
every metric and arm that both sides report.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pdserve.bench.modelled_time import time_scale_of
from pdserve.bench.report import _dig

METRICS: tuple[tuple[str, tuple[str, ...], float], ...] = (
    # (label, path into a bench-serve result, scale to the unit shown)
    ("TTFT p50 (ms)", ("summary", "ttft_ms", "p50"), 1.0),
    ("TTFT p90 (ms)", ("summary", "ttft_ms", "p90"), 1.0),
    ("TPOT p50 (ms)", ("summary", "tpot_ms", "p50"), 1.0),
    ("TPOT p90 (ms)", ("summary", "tpot_ms", "p90"), 1.0),
    ("E2E p50 (ms)", ("summary", "e2e_ms", "p50"), 1.0),
    ("E2E p90 (ms)", ("summary", "e2e_ms", "p90"), 1.0),
    ("goodput vLLM (req/s)", ("goodput", "vllm_req_s"), 1.0),
    ("goodput DistServe (req/s)", ("goodput", "distserve", "interpolated"), 1.0),
    ("prefill s/req", ("summary", "stages", "per_request", "prefill_ms"), 1e-3),
    ("transfer s/req", ("summary", "stages", "per_request", "transfer_ms"), 1e-3),
    ("decode s/req", ("summary", "stages", "per_request", "decode_ms"), 1e-3),
)
# stage rows with a real value this small are not scored (a relative error of noise)
MIN_STAGE_S = 1e-3
# the per-request percentile rows: label -> (record field in seconds, percentile)
PER_REQUEST = {
    f"{name} p{q} (ms)": (f"{name.lower()}_s", q)
    for name in ("TTFT", "TPOT", "E2E")
    for q in (50, 90)
}


def real_ci95(
    real: Mapping[str, Any], label: str, resamples: int = 2000, seed: int = 0
) -> tuple[float, float] | None:
    """The 95 % bootstrap interval (resampling the run's requests) of a percentile row's real
    value, in ms: how far the one real run could have read with other requests of the same
    workload. A TPOT median that falls between requests that shared a step with a long prompt
    and requests that did not moves a lot with a few requests (a code-like trace, 54
    requests: 34 ms, interval 25-65 ms)."""
    if label not in PER_REQUEST:
        return None
    import numpy as np

    field, q = PER_REQUEST[label]
    sweep = real.get("sweep") or []
    records = sweep[0].get("records", []) if sweep else []
    values = np.array([r[field] for r in records if r.get(field) is not None], dtype=float)
    if len(values) < 10:
        return None
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(values), size=(resamples, len(values)))
    stats = np.percentile(values[picks], q, axis=1) * 1e3
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def error_rows(real: Mapping[str, Any], sim: Mapping[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for label, path, scale in METRICS:
        r, s = _dig(real, path), _dig(sim, path)
        r = r * scale if isinstance(r, int | float) else None
        s = s * scale if isinstance(s, int | float) else None
        err = None
        if r is not None and s is not None and r != 0:
            if not (label.endswith("s/req") and abs(r) < MIN_STAGE_S):
                err = abs(s - r) / abs(r)
        row = {"metric": label, "real": r, "sim": s, "rel_error": err}
        ci = real_ci95(real, label) if r is not None else None
        if ci is not None:
            row["real_ci95"] = list(ci)
        rows.append(row)
    return rows


def median_rows(draws: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Error rows of the median simulated value of each metric over several draws of the
    same arm (rows from `error_rows`, one list per draw, same metrics in the same order)."""
    import statistics

    out = []
    for per_draw in zip(*draws, strict=True):
        head = per_draw[0]
        sims = [r["sim"] for r in per_draw if r["sim"] is not None]
        s = statistics.median(sims) if sims else None
        r = head["real"]
        err = None
        if head["rel_error"] is not None and s is not None:
            err = abs(s - r) / abs(r)
        row = {"metric": head["metric"], "real": r, "sim": s, "rel_error": err, "sim_draws": sims}
        if "real_ci95" in head:
            row["real_ci95"] = head["real_ci95"]
        out.append(row)
    return out


def max_rel_error(table: Mapping[str, list[dict[str, Any]]]) -> float | None:
    errs = [
        row["rel_error"] for rows in table.values() for row in rows if row["rel_error"] is not None
    ]
    return max(errs) if errs else None


def format_table(table: Mapping[str, list[dict[str, Any]]]) -> str:
    def f(v: Any) -> str:
        if v is None:
            return "-"
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"

    lines = []
    for arm, rows in table.items():
        head = f"{'[' + arm + ']':<28}{'real':>12}{'sim':>12}{'rel.err':>10}  real 95% CI"
        lines += [head, "-" * len(head)]
        for r in rows:
            err = "-" if r["rel_error"] is None else f"{r['rel_error']:.1%}"
            ci = r.get("real_ci95")
            ci_s = f"  [{f(ci[0])}, {f(ci[1])}]" if ci else ""
            lines.append(f"{r['metric']:<28}{f(r['real']):>12}{f(r['sim']):>12}{err:>10}{ci_s}")
        lines.append("")
    return "\n".join(lines)


def real_results(
    args: argparse.Namespace, arms: dict[str, list[str]], extra: list[str]
) -> dict[str, Any]:
    """Each arm on a fresh `pdserve up` (as `bench compare` runs it), or read from --real."""
    if args.real:
        saved = json.loads(Path(args.real).read_text())
        return {n: saved["arms"][n] for n in arms}
    from pdserve.bench.cluster import UpProcess
    from pdserve.bench.serve import run_benchmark, warm_up

    out = Path(args.out)
    results: dict[str, Any] = {}
    for name, flags in arms.items():
        before = _probe(args)
        print(f"== real arm {name}: pdserve up {shlex.join(flags + extra)}", file=sys.stderr,
              flush=True)  # fmt: skip
        cluster = UpProcess(flags + extra, port=0, ready_timeout_s=args.ready_timeout,
                          log_path=out.parent / f"{out.stem}_{name}_up.log")  # fmt: skip
        arm_args = argparse.Namespace(**vars(args))
        arm_args.clock_scale = time_scale_of(flags + extra)  # emulated: in modelled time
        with cluster as addr:
            overhead = path_overhead_s(addr) if "--emulate" in flags + extra else None
            served = _served_probe(args, addr)
            # the warm-up before the window: its steps are not the workload's, and the
            # simulation that the window's engine seconds are compared with has none
            warm_up(addr, arm_args)
            arm_args.warmup = 0
            window = ArmWindow.open(addr, cluster.tls_dir)
            res = run_benchmark(addr, arm_args)
            machine = window.close()
            served_after = _served_probe(args, addr)
        results[name] = {k: v for k, v in res.items() if not k.startswith("_")}
        results[name]["machine"] = machine
        if served and served_after:
            results[name]["served_probe"] = {"before": served, "after": served_after}
            print("   served probe TTFT " + ", ".join(f"{p['ttft_s'] * 1e3:.1f}" for p in
                  (served, served_after)) + " ms, TPOT " + ", ".join(
                  f"{p['tpot_s'] * 1e3:.2f}" for p in (served, served_after))
                  + " ms (before, after)", file=sys.stderr, flush=True)  # fmt: skip
        if overhead is not None:
            # in modelled seconds, as the cluster's clock runs
            results[name]["path_overhead_s"] = overhead / arm_args.clock_scale
            print(f"   request path overhead {overhead * 1e3:.2f} ms wall", file=sys.stderr,
                  flush=True)  # fmt: skip
        after = _probe(args)
        if before and after:
            results[name]["contention"] = contention(before, after)
            c = results[name]["contention"]
            print(f"   contention factor {before['factor']:.2f} before, {after['factor']:.2f} "
                  f"after: {c['factor']:.2f} (prompt steps {c['prefill_factor']:.2f}, decode "
                  f"steps {c['decode_factor']:.2f})", file=sys.stderr, flush=True)  # fmt: skip
    return results


def contention(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The arm's contention factors: the mean of the probes before and after it, overall and
    per step kind (a probe without kinds gives its one factor to both)."""
    out: dict[str, Any] = {"before": before, "after": after}
    for key in ("factor", "prefill_factor", "decode_factor"):
        b, a = before.get(key, before["factor"]), after.get(key, after["factor"])
        out[key] = (b + a) / 2
    return out


def _served_probe(args: argparse.Namespace, addr: str) -> dict[str, Any] | None:
    """The served probe on the arm's idle cluster (with --probe on a profile)."""
    if not (getattr(args, "probe", False) and args.profile):
        return None
    import asyncio

    from pdserve.sim.served_probe import served_probe

    return asyncio.run(served_probe(addr))


class ArmWindow:
    """The machine over an arm's benchmark: its CPUs (`machine_load`) and each worker's
    engine steps (the Info counters), for the record: where a real run's time went."""

    def __init__(self, addr: str, tls_dir: str | None) -> None:
        self.addr, self.tls_dir = addr, tls_dir
        self.cpu: dict[str, int] | None = None
        self.workers: dict[str, dict[str, float]] = {}
        self.roles: dict[str, str] = {}
        self.started = 0.0

    @classmethod
    def open(cls, addr: str, tls_dir: str | None) -> ArmWindow:
        import time

        from pdserve.sim.machine_load import cpu_times

        w = cls(addr, tls_dir)
        w.workers, w.cpu, w.started = w._counters(), cpu_times(), time.monotonic()
        return w

    def _counters(self) -> dict[str, dict[str, float]]:
        import asyncio

        from pdserve.bench.lengths import worker_counters

        try:
            status, counters = asyncio.run(worker_counters(self.addr, tls_dir=self.tls_dir))
        except Exception:  # diagnostics only: a cluster without the counters reads none
            return {}
        self.roles = {i.instance_id: str(i.role) for i in status.instances}  # "prefill", ...
        return counters

    def close(self) -> dict[str, Any]:
        import time

        from pdserve.sim.machine_load import cpu_times, load_between
        from pdserve.sim.served_steps import StepCounters

        wall = time.monotonic() - self.started
        after, cpu = self._counters(), load_between(self.cpu, cpu_times())
        engines = {}
        for iid, c in after.items():
            now, then = StepCounters.of(c), StepCounters.of(self.workers.get(iid, {}))
            if now is None:
                continue
            w = now.since(then) if then else now
            engines[iid] = {"role": self.roles.get(iid, ""), "steps": w.steps,
                            "step_seconds": w.seconds,
                            "mean_step_s": w.seconds / w.steps if w.steps else None}  # fmt: skip
        return {"wall_s": wall, "cpu": cpu, "engines": engines}


def engine_speed_factors(real: dict[str, Any], sim_engine_s: dict[str, float]) -> dict[str, float]:
    """{role: the real workers' engine seconds over the simulated instances' of that role}:
    how much slower (> 1) the real engines stepped during the benchmark than the model's
    steps of the same run. Roles either side lacks are left out."""
    real_s: dict[str, float] = {}
    for e in ((real.get("machine") or {}).get("engines") or {}).values():
        if e.get("role"):
            real_s[e["role"]] = real_s.get(e["role"], 0.0) + float(e["step_seconds"])
    sim_s: dict[str, float] = {}
    for iid, secs in sim_engine_s.items():
        role = iid.rsplit("-", 1)[0]
        sim_s[role] = sim_s.get(role, 0.0) + secs
    return {r: real_s[r] / sim_s[r] for r in real_s if sim_s.get(r, 0.0) > 0 and real_s[r] > 0}


def _probe(args: argparse.Namespace) -> dict[str, Any] | None:
    if not (getattr(args, "probe", False) and args.profile and args.model):
        return None
    from pdserve.sim.probe import probe_subprocess

    return probe_subprocess(args.model, args.profile)


def path_overhead_s(addr: str, n: int = 12) -> float:
    """This machine's request path outside the worker's compute, measured on an idle
    cluster: sequential 16-token requests (2 tokens: a disaggregated one reaches its decode),
    client TTFT minus the worker's prefill and exposed transfer stages; the median, in wall
    seconds. The simulator charges it as `router_overhead_s` (what `pdserve profile`
    estimates from two gRPC round trips on a quiet machine)."""
    import asyncio
    import statistics

    from pdserve.client import AsyncClient

    async def go() -> list[float]:
        out = []
        async with AsyncClient(addr, timeout=60.0) as client:
            for i in range(n + 2):
                r = await client.generate(
                    token_ids=[1000 + 17 * i + k for k in range(16)], max_tokens=2,
                    ignore_eos=True,
                )  # fmt: skip
                st = r.usage.stages if r.usage else {}
                worker_ms = st.get("prefill_ms", 0.0) + st.get("transfer_ms", 0.0)
                if i >= 2:  # the first two pay connection set-up
                    out.append(max(0.0, r.ttft_ms - worker_ms) / 1e3)
        return out

    return statistics.median(asyncio.run(go()))


def with_router_overhead(costs: Any, overhead_s: float) -> Any:
    """`costs` (one CostModel, or one per role, or a list per mixed role) charging
    `overhead_s` per request."""
    import copy

    if isinstance(costs, dict):
        return {k: with_router_overhead(v, overhead_s) for k, v in costs.items()}
    if isinstance(costs, list):  # a pool of mixed hardware: one per type
        return [with_router_overhead(v, overhead_s) for v in costs]
    out = copy.copy(costs)
    out.router_overhead_s = overhead_s
    return out


def flag_value(flags: list[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` in a command line (the last one given)."""
    out = None
    for i, f in enumerate(flags):
        if f == name and i + 1 < len(flags):
            out = flags[i + 1]
        elif f.startswith(name + "="):
            out = f.split("=", 1)[1]
    return out
