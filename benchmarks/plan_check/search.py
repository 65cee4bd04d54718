"""The logic of `plan_check` (no process, no simulator): one configuration's goodput search
to a stated resolution, the verdict on `plan`'s pick and the spread of the configurations.

Goodput search: the highest rate at which `attain(rate) >= target`, assumed monotone
(a higher rate never attains more). From a start rate (the simulator's answer, so an
emulated search agreeing with it costs two runs), steps of the resolution, each step's
exponent doubled (x 1.1, x 1.21, x 1.46, ...) until a passing and a failing rate bracket
the crossing, then geometric bisection until failing / passing <= 1 + resolution. The
goodput is the highest passing rate: within `resolution` below the true crossing.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RateSearch:
    """One search's visited points (rate -> attainment, in visit order) and its answer."""

    points: list[tuple[float, float]] = field(default_factory=list)
    goodput: float = 0.0  # highest passing rate (0: none passed down to min_rate)
    fail: float | None = None  # lowest failing rate above it (None: never failed)


def search_rate(
    attain: Callable[[float], float],
    start: float,
    target: float = 0.9,
    resolution: float = 0.1,
    min_rate: float = 0.05,
    max_runs: int = 12,
) -> RateSearch:
    """The goodput search described above. `attain(rate)` runs the load at `rate` and
    returns the fraction of requests meeting the SLOs. At most `max_runs` points; when it
    runs out before the bracket closes, `goodput` is the highest passing rate found."""
    if start <= 0 or resolution <= 0:
        raise ValueError(f"start rate {start} and resolution {resolution} must be > 0")
    out = RateSearch()

    def passes(rate: float) -> bool:
        a = attain(rate)
        out.points.append((rate, a))
        return a >= target

    lo: float | None = None
    hi: float | None = None
    up = passes(start)
    if up:
        lo = start
    else:
        hi = start
    step = math.log1p(resolution)  # in log-rate
    while (lo is None or hi is None) and len(out.points) < max_runs:
        rate = (lo * math.exp(step)) if up else (hi * math.exp(-step))  # type: ignore[operator]
        if rate < min_rate:
            break
        if passes(rate):
            lo = rate
            if not up:
                break
        else:
            hi = rate
            if up:
                break
        step *= 2
    while lo is not None and hi is not None and hi / lo > 1 + resolution + 1e-9:
        if len(out.points) >= max_runs:
            break
        mid = math.sqrt(lo * hi)
        if passes(mid):
            lo = mid
        else:
            hi = mid
    out.goodput = lo or 0.0
    out.fail = hi
    return out


@dataclass(frozen=True)
class Verdict:
    pick: str
    best: str  # the configuration with the highest emulated per-device goodput
    shortfall: float  # 1 - pick / best (0: the pick is the best)
    spread: float | None  # max / min emulated per-device goodput (None: a minimum of 0)
    tolerance: float
    min_spread: float

    @property
    def within(self) -> bool:
        return self.shortfall <= self.tolerance + 1e-12

    @property
    def spread_ok(self) -> bool:
        return self.spread is None or self.spread >= self.min_spread

    def to_json(self) -> dict[str, Any]:
        return {
            "pick": self.pick, "emulated_best": self.best, "shortfall": self.shortfall,
            "within_tolerance": self.within, "tolerance": self.tolerance,
            "spread": self.spread, "spread_ok": self.spread_ok, "min_spread": self.min_spread,
        }  # fmt: skip


def verdict(
    per_device: Mapping[str, float],
    pick: str,
    tolerance: float = 0.1,
    min_spread: float = 1.5,
) -> Verdict:
    """`per_device`: configuration -> emulated goodput per device. The pick passes when its
    goodput is within `tolerance` of the best one's; the spread is max / min (None, i.e.
    unbounded, when some configuration has no passing rate at all)."""
    if pick not in per_device:
        raise ValueError(f"plan's pick {pick!r} is not among the configurations checked")
    best = max(per_device, key=lambda k: per_device[k])
    top, lowest = per_device[best], min(per_device.values())
    shortfall = 0.0 if top <= 0 else 1.0 - per_device[pick] / top
    spread = None if lowest <= 0 else top / lowest
    return Verdict(pick, best, shortfall, spread, tolerance, min_spread)


def ranks(values: Mapping[str, float]) -> dict[str, int]:
    """1 = highest; equal values share the better rank."""
    ordered = sorted(values.values(), reverse=True)
    return {k: ordered.index(v) + 1 for k, v in values.items()}


def format_table(rows: Sequence[Mapping[str, Any]], v: Verdict, on: str = "emulated") -> str:
    """configuration | devices | simulated goodput | emulated goodput | ranks | step lag |
    the simulator's largest error against emulation on the same requests (`metrics.pair_errors`);
    `on`: the goodputs the verdict compares (emulated; simulated on a dry run)."""

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    sim = ranks({r["config"]: r["sim_per_device"] for r in rows})
    emu = ranks({r["config"]: r["emu_per_device"] for r in rows
                 if r.get("emu_per_device") is not None})  # fmt: skip
    head = (f"{'configuration':<34}{'dev':>4}{'sim req/s':>11}{'/dev':>7}{'emu req/s':>11}"
            f"{'/dev':>7}{'rank sim':>9}{'rank emu':>9}{'lag max':>9}{'sim err':>9}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows:
        lag = r.get("step_lag_max")
        mark = " <- plan" if r["config"] == v.pick else ""
        lines.append(
            f"{r['config']:<34}{r['devices']:>4}{r['sim_goodput']:>11.2f}"
            f"{r['sim_per_device']:>7.2f}{f(r.get('emu_goodput'), '.2f'):>11}"
            f"{f(r.get('emu_per_device'), '.2f'):>7}{sim[r['config']]:>9}"
            f"{emu.get(r['config'], '-'):>9}"
            f"{'-' if lag is None else f'{lag:.2%}':>9}"
            f"{f(r.get('vs_sim_max_rel_error'), '.1%'):>9}{mark}"
        )
    spread = "unbounded (a configuration passed at no rate)" if v.spread is None else (
        f"{v.spread:.2f}x")  # fmt: skip
    lines += [
        "",
        f"plan's pick: {v.pick}; {on} best: {v.best}",
        f"plan's pick is within {v.shortfall:.1%} of the {on} best "
        f"({'PASS' if v.within else 'FAIL'}: <= {v.tolerance:.0%})",
        f"spread of {on} per-device goodput (max / min): {spread} "
        f"({'ok' if v.spread_ok else 'TOO SMALL'}: >= {v.min_spread:g}x)",
    ]
    return "\n".join(lines)
