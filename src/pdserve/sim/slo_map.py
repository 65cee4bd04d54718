"""`pdserve plan --map`: where disaggregation wins, over a grid of TTFT x TPOT SLOs.

Each cell of the grid is `plan`'s question under that cell's SLOs: the best colocated unit
(chunked prefill at each token budget, or no chunking) and the best disaggregated one, each
replicated to the budget and walked at full scale (`plan.py`), and the ratio of their
per-device goodputs. Asked cell by cell that is cells x plan's simulations. It is not
needed: a simulated run does not depend on the SLOs (the same requests, the same schedule),
so one run at a rate answers every cell's attainment at that rate (its records rescored, as
`bench rescore` does). And every cell's search of a unit starts from the same rate and
visits rates of one lattice (doubling, then bisecting the bracket), so cells share most of
their points. One run serves all cells:

- a point is (unit, replicas, rate); its run stops early only when it fails the *loosest*
  cell (a request that misses the loosest SLOs misses every cell's), so a run that stops
  fails every cell and one that finishes is scored for each;
- each (unit, cell) search is `plan`'s (`plan_search.sweep_need`, replayed over the points
  known so far), and a kind's full-scale walk in a cell (`parallel.walk_need`) starts once
  its best unit there is decided;
- a unit's search in a cell stops as soon as it cannot beat the best finished unit of its
  kind there (its lowest failing rate bounds its answer), which `plan` would not have picked.

Kinds: "colocated" is the best of the chunked and unchunked colocated units, "disagg" the
best M:N unit (with TP and hardware per pool when the budget offers several).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.sim import parallel
from pdserve.sim.candidates import NOCHUNK, Budget, Candidate
from pdserve.sim.plan_search import sweep_need, unit_summary
from pdserve.sim.run import base_for, simulate_once
from pdserve.workload.goodput import SLO, SweepPoint, attainment

GROUPS = ("colocated", "disagg")


def group_of(cand: Candidate) -> str:
    return "disagg" if cand.kind == "disagg" else "colocated"


@dataclass(frozen=True)
class Grid:
    """TTFT x TPOT SLOs (ms); cells row-major: TTFT rows, TPOT columns."""

    ttft_ms: tuple[float, ...]
    tpot_ms: tuple[float, ...]

    @classmethod
    def parse(cls, ttft: str, tpot: str) -> Grid:
        def values(name: str, s: str) -> tuple[float, ...]:
            try:
                vals = tuple(sorted({float(x) for x in s.split(",") if x.strip()}))
            except ValueError:
                raise ValueError(f"bad --map-{name} {s!r}: comma-separated ms") from None
            if not vals or min(vals) <= 0:
                raise ValueError(f"bad --map-{name} {s!r}: one or more values > 0 ms")
            return vals

        return cls(values("ttft", ttft), values("tpot", tpot))

    def cells(self) -> list[SLO]:
        return [SLO(ttft_ms=t, tpot_ms=p) for t, p in itertools.product(self.ttft_ms, self.tpot_ms)]

    def loosest(self) -> SLO:
        return SLO(ttft_ms=max(self.ttft_ms), tpot_ms=max(self.tpot_ms))


def score_cells(records: Sequence[Any], cells: Sequence[SLO]) -> list[float]:
    """Each cell's attainment of one run's records (`workload.goodput.attainment`)."""
    return [attainment(records, c) for c in cells]


def map_point(i: int, replicas: int, rate: float) -> dict[str, Any]:
    """One run of candidate i x `replicas` at `rate`, scored for every cell (in a worker:
    the inputs from parallel.CONTEXT)."""
    c = parallel.CONTEXT
    cand, args, cells = c["cands"][i], c["args"], c["cells"]
    spec = cand.spec(replicas, c["max_model_len"], args.block_size)
    run = simulate_once(spec, args, rate, c["loosest"], early_stop_target=c["target"],
                        keep_records=False)  # fmt: skip
    s, stopped = run["summary"], run["sim"]["stopped_early"]
    return {
        "attainment": score_cells(run["_records"], cells),
        "stopped_early": stopped,
        "out_tokens": None if stopped or not s["completed"]
        else s["total_output_tokens"] / s["completed"],
        "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
        "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p90_ms": s["tpot_ms"]["p90"],
    }  # fmt: skip


Point = tuple[int, int, float]  # (candidate, replicas, rate)


class MapSearch:
    """Every (unit, cell) goodput search and every (cell, kind) full-scale walk over one
    shared table of runs. `evaluate(points)` runs points (on processes) and returns their
    results; the searches are `plan`'s, so a cell's answer is the one `plan` gives under
    its SLOs (pruned units aside, which cannot change the best)."""

    def __init__(self, cands: Sequence[Candidate], budget: Budget, cells: Sequence[SLO],
                 start_rate: float, target: float) -> None:  # fmt: skip
        self.cands, self.budget, self.cells, self.target = cands, budget, cells, target
        self.runs: dict[tuple[int, int], dict[float, dict[str, Any]]] = {}
        self.need = [sweep_need(start_rate * c.num_devices, target) for c in cands]
        self.walks: dict[tuple[int, str], tuple[int, int, float]] = {}  # -> (cand, reps, start)

    # ---- what each search knows and needs
    def known(self, i: int, reps: int, cell: int) -> dict[float, float]:
        return {r: res["attainment"][cell] for r, res in self.runs.get((i, reps), {}).items()}

    def unit_done(self, i: int, cell: int) -> bool:
        return self.need[i](self.known(i, 1, cell)) is None

    def unit(self, i: int, cell: int) -> dict[str, Any]:
        known = self.known(i, 1, cell)
        path: dict[float, float] = {}
        while (rate := self.need[i](path)) is not None and rate in known:
            path[rate] = known[rate]
        runs = self.runs.get((i, 1), {})
        outs = [runs[r]["out_tokens"] for r in path if runs[r]["out_tokens"] is not None]
        return unit_summary(self.cands[i], [SweepPoint(r, a) for r, a in path.items()], outs,
                            self.target)  # fmt: skip

    def _bound(self, i: int, cell: int) -> float:
        """Upper bound of unit i's per-device goodput in `cell` (its lowest failing rate)."""
        fails = [r for r, a in self.known(i, 1, cell).items() if a < self.target]
        return (min(fails) if fails else math.inf) / self.cands[i].num_devices

    def best(self, cell: int, group: str) -> tuple[int | None, bool]:
        """(the group's best finished unit in `cell`, whether no unfinished one can beat it:
        `max` keeps the first of equals, as `plan_search.PlanSearch._decided`)."""
        idx = [i for i, c in enumerate(self.cands) if group_of(c) == group]
        done = [i for i in idx if self.unit_done(i, cell)]
        if not done:
            return None, False
        top = max(done, key=lambda i: self.unit(i, cell)["per_device_goodput"])
        val = self.unit(top, cell)["per_device_goodput"]
        open_ = [i for i in idx if i not in done]
        beaten = all((self._bound(i, cell) <= val) if i > top else (self._bound(i, cell) < val)
                     for i in open_)  # fmt: skip
        return top, beaten

    def needs(self) -> list[Point]:
        """The points some search needs next (units before walks, no duplicates)."""
        out: dict[Point, None] = {}
        for cell in range(len(self.cells)):
            for group in GROUPS:
                top, decided = self.best(cell, group)
                for i, c in enumerate(self.cands):
                    if group_of(c) != group or self.unit_done(i, cell):
                        continue
                    if top is not None and self._bound(i, cell) < self.unit(top, cell)[
                            "per_device_goodput"]:  # fmt: skip
                        continue  # cannot beat the best finished unit of its kind here
                    rate = self.need[i](self.known(i, 1, cell))
                    if rate is not None:
                        out[(i, 1, rate)] = None
                if decided and top is not None:
                    self._walk_needs(cell, group, top, out)
        return list(out)

    def _walk_needs(self, cell: int, group: str, top: int, out: dict[Point, None]) -> None:
        if (cell, group) not in self.walks:
            unit = self.cands[top].devices()
            reps = min(self.budget.devices[hw] // n for hw, n in unit.items())
            start = self.unit(top, cell)["goodput_req_s"] * reps
            self.walks[(cell, group)] = (top, reps, start)
        i, reps, start = self.walks[(cell, group)]
        rate = parallel.walk_need(start, self.target)(self.known(i, reps, cell))
        if rate is not None:
            out[(i, reps, rate)] = None

    def run(self, evaluate: Callable[[list[Point]], list[dict[str, Any]]],
            log: Callable[[str], None] = lambda m: None) -> int:  # fmt: skip
        """Until no search needs a point; returns the number of runs."""
        n = 0
        while todo := self.needs():
            for (i, reps, rate), res in zip(todo, evaluate(todo), strict=True):
                self.runs.setdefault((i, reps), {})[rate] = res
            n += len(todo)
            log(f"  {n} runs ({len(todo)} in this round)")
        return n

    # ---- the answer
    def _walk(self, cell: int, group: str) -> tuple[parallel.Search, float]:
        i, reps, start = self.walks[(cell, group)]
        walk = parallel.Search("walk", parallel.walk_need(start, self.target), map_point,
                               (i, reps), self.target)  # fmt: skip
        walk.known = self.known(i, reps, cell)
        walk.results = self.runs.get((i, reps), {})
        return walk, start

    def points_per_cell(self) -> int:
        """What asking `plan` cell by cell would have run (at least: units pruned here would
        have run to the end): each finished unit search's points and each walk's."""
        n = sum(len(self.unit(i, k)["points"]) for k in range(len(self.cells))
                for i in range(len(self.cands)) if self.unit_done(i, k))  # fmt: skip
        return n + sum(len(self._walk(k, g)[0].path()) for k, g in self.walks)

    def cell_result(self, cell: int) -> dict[str, Any]:
        slo = self.cells[cell]
        out: dict[str, Any] = {"ttft_ms": slo.ttft_ms, "tpot_ms": slo.tpot_ms}
        for group in GROUPS:
            if (cell, group) not in self.walks:
                out[group] = None
                continue
            i, reps, _ = self.walks[(cell, group)]
            cand, unit = self.cands[i], self.unit(i, cell)
            walk, start = self._walk(cell, group)
            rate, res = parallel.walk_answer(start, walk)
            devices = sum(cand.devices().values()) * reps
            out[group] = {
                "unit": cand.label, "kind": cand.kind, "replicas": reps, "devices": devices,
                "unit_goodput_req_s": unit["goodput_req_s"],
                "unit_per_device_goodput": unit["per_device_goodput"],
                "goodput_req_s": rate, "per_device_goodput": rate / devices,
                "full_scale": None if res is None else {
                    k: res.get(k) for k in ("ttft_p50_ms", "ttft_p90_ms", "tpot_p50_ms",
                                            "tpot_p90_ms")
                } | {"attainment": res["attainment"][cell]},
            }  # fmt: skip
        c, d = out["colocated"], out["disagg"]
        out["ratio"] = (d["per_device_goodput"] / c["per_device_goodput"]
                        if c and d and c["per_device_goodput"] > 0 else None)  # fmt: skip
        out["unit_ratio"] = (d["unit_per_device_goodput"] / c["unit_per_device_goodput"]
                             if c and d and c["unit_per_device_goodput"] > 0 else None)  # fmt: skip
        return out


def pool_evaluator(runner: parallel.Runner) -> Callable[[list[Point]], list[dict[str, Any]]]:
    """Runs a round's points on the runner's processes, results in the points' order."""

    def evaluate(points: list[Point]) -> list[dict[str, Any]]:
        results: dict[int, dict[str, Any]] = {}
        tickets: dict[int, int] = {}
        todo = list(enumerate(points))
        while todo or tickets:
            while todo and len(tickets) < runner.jobs:
                k, (i, reps, rate) = todo.pop(0)
                tickets[runner.submit(map_point, i, reps, rate)] = k
            ticket, res = runner.wait()
            results[tickets.pop(ticket)] = res
        return [results[k] for k in range(len(points))]

    return evaluate


def slo_map(args: argparse.Namespace, budget: Budget, cands: Sequence[Candidate], grid: Grid,
            max_model_len: int, target: float = 0.9,
            log: Callable[[str], None] = print) -> dict[str, Any]:  # fmt: skip
    """The map: per cell the best colocated and disaggregated configurations and the ratio
    of their per-device goodputs."""
    cells = grid.cells()
    jobs = getattr(args, "jobs", 1) or os.cpu_count() or 1
    log(f"{len(cands)} candidate units x {len(cells)} SLO cells; {jobs} processes ...")
    base_for(args, 0)  # read the trace once, before the workers fork
    parallel.CONTEXT.update(args=args, cells=cells, loosest=grid.loosest(), target=target,
                            max_model_len=max_model_len, cands=cands)  # fmt: skip
    search = MapSearch(cands, budget, cells, args.start_rate, target)
    with parallel.Runner(jobs) as runner:
        runs = search.run(pool_evaluator(runner), log)
    return {
        "grid": {"ttft_ms": list(grid.ttft_ms), "tpot_ms": list(grid.tpot_ms)},
        "target": target,
        "cells": [search.cell_result(k) for k in range(len(cells))],
        "runs": runs,
        "runs_cell_by_cell": search.points_per_cell(),
        "candidates": [c.label for c in cands],
        "nochunk_candidates": sum(c.kind == NOCHUNK for c in cands),
    }
