"""Statistics and tables of the evidence runs: per-seed runs of each arm, paired with the
baseline arm's run of the same seed (the same requests: checked by their digest), reduced to
the mean and 95 % half-width (Student's t over seeds) of each metric and of each paired gain.
The simulated and the emulated runs of one seed must have run the same requests too."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

T95 = {2: 12.706, 3: 4.303, 4: 3.182, 5: 2.776, 6: 2.571, 7: 2.447, 8: 2.365, 9: 2.306, 10: 2.262}
METRICS = ("goodput", "attainment", "e2e_mean", "e2e_p99", "preemptions", "flips")
GAINS = ("goodput", "attainment", "e2e_mean", "e2e_p99", "preemptions")


class PairingError(ValueError):
    """Two runs meant to be paired did not run the same seeds or the same requests."""


def ci(xs: list[float]) -> tuple[float, float]:
    """Mean and 95 % half-width (Student's t)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, math.nan
    return m, T95.get(len(xs), 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def pair(runs: list[dict[str, Any]], base: list[dict[str, Any]], what: str) -> list[tuple]:
    """(run, base run) by seed; both lists must hold the same seeds run on the same requests."""
    by_seed = {b["seed"]: b for b in base}
    if sorted(by_seed) != sorted(r["seed"] for r in runs) or len(by_seed) != len(runs):
        raise PairingError(f"{what}: seeds {[r['seed'] for r in runs]} vs {sorted(by_seed)}")
    out = []
    for r in runs:
        b = by_seed[r["seed"]]
        if r.get("requests") != b.get("requests"):
            raise PairingError(f"{what}, seed {r['seed']}: different requests "
                               f"({r.get('requests')} vs {b.get('requests')})")  # fmt: skip
        out.append((r, b))
    return out


def arm_stats(per_arm: dict[str, list[dict[str, Any]]], base: str) -> dict[str, dict[str, Any]]:
    """Per arm: each metric's (mean, half-width) over seeds and, for a non-baseline arm,
    `<metric>_gain_pct`: the per-seed paired difference to the baseline as a % of the
    baseline's mean. A metric some run lacks (None) is left out."""
    out: dict[str, dict[str, Any]] = {}
    for arm, runs in per_arm.items():
        pairs = pair(runs, per_arm[base], f"arm {arm!r} vs {base!r}")
        st: dict[str, Any] = {"seeds": len(runs)}
        for key in METRICS:
            if any(r.get(key) is None for r in runs):
                continue
            st[key] = ci([r[key] for r in runs])
            if arm != base and key in GAINS and all(b.get(key) is not None for _, b in pairs):
                bm = statistics.fmean(b[key] for _, b in pairs)
                st[f"{key}_gain_pct"] = ci(
                    [100.0 * (r[key] - b[key]) / bm if bm else 0.0 for r, b in pairs]
                )
        taus = [r["tau"] for r in runs if r.get("tau") is not None]
        st["tau"] = statistics.fmean(taus) if taus else None
        out[arm] = st
    return out


def emulated_block(sim: list[dict[str, Any]], emu: list[dict[str, Any]], st: dict[str, Any]):
    """An arm's emulated statistics, after checking that each emulated run served the same
    requests as its simulated twin; with the step lag (mean and worst run), the worst client
    send lag and prompts whose token count differed from the twin's (should be 0)."""
    pair(emu, sim, "emulated vs simulated")
    lags = [r["step_lag"] for r in emu if r.get("step_lag") is not None]
    gaps = [r["step_gap"] for r in emu if r.get("step_gap") is not None]
    return st | {
        "step_lag": (statistics.fmean(lags), max(lags)) if lags else None,
        "step_gap": (statistics.fmean(gaps), max(gaps)) if gaps else None,
        "send_lag_ms_max": max((r.get("send_lag_ms_max") or 0.0) for r in emu),
        "prompt_tokens_differ": sum(r.get("prompt_tokens_differ") or 0 for r in emu),
        "wall_s_mean": statistics.fmean(r.get("wall_s") or 0.0 for r in emu),
    }


def setup_rows(
    meta: dict[str, Any],
    base: str,
    per_arm: dict[str, list[dict[str, Any]]],
    emu_arm: dict[str, list[dict[str, Any]]] | None = None,
) -> list[dict[str, Any]]:
    """One row per arm: `meta`, the simulated statistics and, with emulated runs, an
    `emulated` block of the same statistics."""
    sim = arm_stats(per_arm, base)
    emu = arm_stats(emu_arm, base) if emu_arm else {}
    rows = []
    for arm in per_arm:
        row = {**meta, "arm": arm, "baseline": base, **sim[arm]}
        if arm in emu and emu_arm is not None:
            row["emulated"] = emulated_block(per_arm[arm], emu_arm[arm], emu[arm])
        rows.append(row)
    return rows


def _pm(v: Any, fmt: str = ".1f", scale: float = 1.0) -> str:
    if v is None:
        return "-"
    m, h = v[0] / scale, v[1] / scale
    return f"{m:{fmt}} ± {h:{fmt}}" if not math.isnan(h) else f"{m:{fmt}}"


def _rows(paths: list[str]) -> list[dict[str, Any]]:
    return [r for p in paths for s in json.loads(Path(p).read_text())["setups"] for r in s["rows"]]


def table(paths: list[str]) -> str:
    """The markdown evidence table of saved results: per arm the mean ± 95 % half-width over
    seeds, and the paired gain vs the baseline in % (+ = more goodput / more E2E). Rows with
    an emulated block get a second table: simulation and emulation side by side."""
    head = ("| policy | workload | cluster | arm | goodput (req/s) | attainment | mean E2E (s) "
            "| p99 E2E (s) | goodput gain % | mean E2E gain % | p99 E2E gain % | preemptions | tau |")  # fmt: skip
    lines = [head, "|" + "---|" * 13]
    rows = _rows(paths)
    for r in rows:
        gains = [_pm(r[k]) if k in r else "baseline"
                 for k in ("goodput_gain_pct", "e2e_mean_gain_pct", "e2e_p99_gain_pct")]  # fmt: skip
        tau = f"{r['tau']:.2f}" if r.get("tau") is not None else "-"
        lines.append(
            f"| {r['group']} | {r['workload']} @ {r['rate']:g}/s | {r['cluster']} | {r['arm']} "
            f"| {_pm(r['goodput'], '.2f')} | {_pm(r['attainment'], '.2f')} "
            f"| {_pm(r['e2e_mean'], '.2f', 1e3)} | {_pm(r['e2e_p99'], '.1f', 1e3)} "
            f"| {' | '.join(gains)} | {r['preemptions'][0]:.0f} | {tau} |"
        )
    emu = [r for r in rows if "emulated" in r]
    if emu:
        lines += ["", side_by_side(emu)]
    return "\n".join(lines)


def side_by_side(rows: list[dict[str, Any]]) -> str:
    """Simulation | emulation per arm: goodput, its gain, mean-E2E gain, p99 E2E, preemptions."""
    lines = [
        "| policy | workload | cluster | arm | goodput sim | goodput emu | goodput gain % sim "
        "| goodput gain % emu | mean E2E gain % sim | mean E2E gain % emu | mean E2E (s) sim "
        "| mean E2E (s) emu | p99 E2E (s) sim | p99 E2E (s) emu | preemptions sim / emu "
        "| step lag (mean, worst); gap between steps |",
        "|" + "---|" * 16,
    ]
    for r in rows:
        e = r["emulated"]

        def g(d: dict[str, Any], k: str) -> str:
            return _pm(d[k]) if k in d else "baseline"

        lag, gap = e.get("step_lag"), e.get("step_gap")
        lag_s = f"{lag[0]:.1%}, {lag[1]:.1%}" if lag else "-"
        if gap:  # runs before the gap counter have none
            lag_s += f"; gap {gap[0]:.1%}, {gap[1]:.1%}"
        lines.append(
            f"| {r['group']} | {r['workload']} @ {r['rate']:g}/s | {r['cluster']} | {r['arm']} "
            f"| {_pm(r['goodput'], '.2f')} | {_pm(e.get('goodput'), '.2f')} "
            f"| {g(r, 'goodput_gain_pct')} | {g(e, 'goodput_gain_pct')} "
            f"| {g(r, 'e2e_mean_gain_pct')} | {g(e, 'e2e_mean_gain_pct')} "
            f"| {_pm(r['e2e_mean'], '.2f', 1e3)} | {_pm(e.get('e2e_mean'), '.2f', 1e3)} "
            f"| {_pm(r['e2e_p99'], '.1f', 1e3)} | {_pm(e.get('e2e_p99'), '.1f', 1e3)} "
            f"| {r['preemptions'][0]:.0f} / {e['preemptions'][0]:.0f} | {lag_s} |"
        )
    return "\n".join(lines)


def merge(paths: list[str]) -> dict[str, Any]:
    """Saved results of the same setups run on different seeds (`--seed-list`), as one: each
    setup's runs (simulated and emulated) concatenated, its rows recomputed over all seeds."""
    setups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for p in paths:
        for s in json.loads(Path(p).read_text())["setups"]:
            r0 = s["rows"][0]
            key = (r0["group"], r0["workload"], r0["cluster"])
            m = setups.setdefault(key, {"meta": r0, "runs": {}, "emulated_runs": {}})
            for k in ("runs", "emulated_runs"):
                for arm, runs in (s.get(k) or {}).items():
                    m[k].setdefault(arm, []).extend(runs)
    out = []
    for m in setups.values():
        r0 = m["meta"]
        meta = {k: r0[k] for k in ("group", "workload", "cluster", "rate", "n", "slo")}
        for k in ("runs", "emulated_runs"):  # pair by seed
            m[k] = {a: sorted(v, key=lambda r: r["seed"]) for a, v in m[k].items()}
        emu = m["emulated_runs"] or None
        out.append({"rows": setup_rows(meta, r0["baseline"], m["runs"], emu), "runs": m["runs"],
                    **({"emulated_runs": emu} if emu else {})})  # fmt: skip
    return {"setups": out, "merged": paths}
