"""`plan`'s searches as point tasks on `parallel.Scheduler`: every candidate unit's goodput
search (`workload.goodput.search_goodput_rate`, replayed: `sweep_need`) and, per kind, the
full-scale 10 % walk of the best unit, started as soon as that best unit is decided (its own
search over and no unfinished search of the kind able to beat it), while other units'
searches still run. The answer is that of running the searches one after the other: each
search visits the rates its sequential version visits, and a kind's best unit is the one
`max` over the finished searches picks (the first of equal per-device goodputs).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pdserve.sim import parallel
from pdserve.sim.run import simulate_once
from pdserve.workload.goodput import SweepPoint, distserve_goodput, search_goodput_rate

if TYPE_CHECKING:
    from pdserve.sim.candidates import Budget, Candidate

MAX_STEPS = 10  # doublings (or halvings) before the bracket gives up
BISECT_STEPS = 3
WALK_PRIORITY = 1e9  # full-scale walks before unit points: they are the search's tail


class _Need(Exception):
    def __init__(self, rate: float) -> None:
        self.rate = rate


def sweep_need(start: float, target: float) -> Callable[[Mapping[float, float]], float | None]:
    """`need` of a unit's goodput search: `search_goodput_rate` from `start` replayed over
    the known attainments, stopped at the first rate it has not measured (same float
    arithmetic, so the same rates)."""

    def need(known: Mapping[float, float]) -> float | None:
        def measure(rate: float) -> float:
            if rate in known:
                return known[rate]
            raise _Need(rate)

        try:
            search_goodput_rate(measure, start, target, MAX_STEPS, BISECT_STEPS)
        except _Need as n:
            return n.rate
        return None

    return need


def unit_result(cand: Candidate, s: parallel.Search, target: float) -> dict[str, Any]:
    """A finished unit search as `plan` reports it (points and outputs in visit order)."""
    path = s.path()
    points = [SweepPoint(r, s.known[r]) for r in path]
    outputs = [s.results[r]["out_tokens"] for r in path if s.results[r]["out_tokens"] is not None]
    return unit_summary(cand, points, outputs, target)


def unit_summary(
    cand: Candidate, points: Sequence[SweepPoint], outputs: Sequence[float], target: float
) -> dict[str, Any]:
    """One unit's search result as `plan` reports it, from its visited points (in order) and
    the mean output tokens of its completed runs."""
    rate = distserve_goodput(list(points), target)["max_rate"] or 0.0
    return {
        "label": cand.label,
        "goodput_req_s": rate,
        "per_device_goodput": rate / cand.num_devices,
        "devices": cand.devices(),
        "points": [(p.rate, p.attainment) for p in points],
        "mean_output_tokens": (sum(outputs) / len(outputs)) if outputs else 0.0,
    }


def _bounds(s: parallel.Search, target: float) -> float:
    """An upper bound on a running search's final goodput: its lowest failing rate visited
    (the answer is a passing rate below every failing one); unbounded before any fails."""
    fails = [r for r in s.path() if s.known[r] < target]
    return min(fails) if fails else math.inf


class PlanSearch:
    """The unit searches and the full-scale walks of one `plan`, on `runner`."""

    def __init__(
        self,
        runner: parallel.Runner,
        cands: Sequence[Candidate],
        budget: Budget,
        start_rate: float,
        target: float,
        kinds: Sequence[str],
        log: Callable[[str], None],
    ) -> None:
        self.cands, self.budget, self.target, self.kinds, self.log = (
            cands, budget, target, kinds, log)  # fmt: skip
        self.sched = parallel.Scheduler(runner)
        self.sweeps: list[parallel.Search] = []
        self._per_kind = {k: sum(c.kind == k for c in cands) for k in kinds}
        for i, cand in enumerate(cands):
            start = start_rate * cand.num_devices
            s = parallel.Search(cand.label, sweep_need(start, target), _point_task, (i,), target)
            self.sweeps.append(s)
            self.sched.add(s)
        self._prioritise()
        self.units: list[dict[str, Any] | None] = [None] * len(cands)
        # kind -> (best unit's result, replicas, walk start rate, walk search)
        self.walks: dict[str, tuple[dict[str, Any], int, float, parallel.Search | None]] = {}

    def run(self) -> None:
        self.sched.run(self._on_result)
        # kinds in KINDS order, as the sequential search reported them
        self.walks = {k: self.walks[k] for k in self.kinds if k in self.walks}

    def _prioritise(self) -> None:
        """Order of the points (the answer does not depend on it). The full-scale walks are
        the long tail, so what decides a kind's best unit goes first: kinds with fewer
        candidates, then (best first) the units that could still have the highest per-device
        goodput (no failing rate yet: unbounded; then bigger units, whose points cost more)."""
        n = len(self.cands)
        for i, (c, s) in enumerate(zip(self.cands, self.sweeps, strict=True)):
            up = min(_bounds(s, self.target) / c.num_devices, 1e6)
            s.priority = (
                -self._per_kind.get(c.kind, 0) * 1e8 + up + c.num_devices * 1e-3 - i / n * 1e-4
            )

    def _on_result(self, s: parallel.Search) -> None:
        for i, sw in enumerate(self.sweeps):
            if self.units[i] is None and sw.need(sw.known) is None:
                self.units[i] = res = unit_result(self.cands[i], sw, self.target)
                res["candidate"] = self.cands[i]
                done = sum(u is not None for u in self.units)
                self.log(f"  [{done}/{len(self.cands)}] {res['label']}: "
                         f"{res['goodput_req_s']:.2f} req/s, "
                         f"{res['per_device_goodput']:.2f} req/s/device")  # fmt: skip
        self._prioritise()
        for kind in self.kinds:
            if kind not in self.walks:
                top = self._decided(kind)
                if top is not None:
                    self._start_walk(kind, top)

    def _decided(self, kind: str) -> int | None:
        """The index of the kind's best unit once no unfinished search can change it."""
        idx = [i for i, c in enumerate(self.cands) if c.kind == kind]
        finished = [i for i in idx if self.units[i] is not None]
        if not finished:
            return None
        best = max(finished, key=lambda i: self.units[i]["per_device_goodput"])  # type: ignore[index]
        val = self.units[best]["per_device_goodput"]  # type: ignore[index]
        for i in idx:
            if self.units[i] is not None:
                continue
            up = _bounds(self.sweeps[i], self.target) / self.cands[i].num_devices
            # max() keeps the first of equals: a later unit must not exceed, an earlier one
            # must stay strictly below (its final goodput is below `up`, rounding aside)
            if not (up <= val if i > best else up < val):
                return None
        return best

    def _start_walk(self, kind: str, i: int) -> None:
        top = self.units[i]
        assert top is not None
        unit = self.cands[i].devices()
        replicas = min(self.budget.devices[hw] // n for hw, n in unit.items())
        start = top["goodput_req_s"] * replicas
        walk = None
        if start > 0:
            self.log(f"best {kind} unit: {top['label']}; full-scale walk from "
                     f"{start:.1f} req/s ({replicas} replicas)")  # fmt: skip
            walk = parallel.Search(f"{kind} x{replicas}", parallel.walk_need(start, self.target),
                                   _full_task, (i, replicas), self.target,
                                   priority=WALK_PRIORITY, eager=True, optimistic=True)  # fmt: skip
            self.sched.add(walk)
        self.walks[kind] = (top, replicas, start, walk)


def _point_task(i: int, rate: float) -> dict[str, Any]:
    """One point of candidate i's goodput search (in a worker: inputs from CONTEXT)."""
    c = parallel.CONTEXT
    cand, args = c["cands"][i], c["args"]
    spec = cand.spec(1, c["max_model_len"], args.block_size)
    run = simulate_once(spec, args, rate, c["slo"], early_stop_target=c["target"],
                        keep_records=False)  # fmt: skip
    s = run["summary"]
    out = None
    if s["completed"] and not run["sim"]["stopped_early"]:
        out = s["total_output_tokens"] / s["completed"]
    return {"attainment": run["attainment_ttft_tpot"] or 0.0, "out_tokens": out}


def _full_task(i: int, replicas: int, rate: float) -> dict[str, Any]:
    """One point of a full-scale walk: candidate i replicated `replicas` times."""
    from pdserve.sim.candidates import latency_at

    c = parallel.CONTEXT
    # a failing point's figures are never reported (only the highest passing one's): stop it
    # as soon as it is known to fail
    return latency_at(c["cands"][i], replicas, c["args"], c["slo"], c["max_model_len"], rate,
                      early_stop_target=c["target"])  # fmt: skip
