"""A plan's simulations on several processes, with the sequential answer.

Each simulation is a pure function of its inputs, so running independent ones on `jobs`
forked processes changes only the wall time. The shared inputs (the parsed trace, the
candidates, the SLOs) are put in `CONTEXT` before the pool forks, so each task carries only
an index and a rate, and no worker re-reads the trace.

`full_scale_walks` runs `refine`'s 10 % walk (up from the unit estimate while it passes, down
while it fails, at most 3 steps) for several configurations at once, evaluating the walk's
next points speculatively when processes are free: the points the sequential walk would
visit are the same, so the answer is identical; only mispredicted points are wasted work.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from typing import Any

CONTEXT: dict[str, Any] = {}  # set before the pool forks; read by the tasks in the workers
STEP = 1.1
MAX_STEPS = 3


class Runner:
    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self._pool: ProcessPoolExecutor | None = None
        if self.jobs > 1:
            ctx = multiprocessing.get_context("fork")
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=ctx)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        if self._pool is None:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def walk_rates(start: float, up: bool) -> list[float]:
    """The rates the sequential walk visits (the same float arithmetic: repeated *=)."""
    rates, rate = [start], start
    step = STEP if up else 1 / STEP
    for _ in range(MAX_STEPS):
        rate *= step
        rates.append(rate)
    return rates


def _advance(start: float, results: dict[float, bool]) -> tuple[list[float], float | None]:
    """(rates still to evaluate, in the order the walk needs them; the highest passing rate
    when the walk is over, else None)."""
    if start not in results:
        return [start, *walk_rates(start, True)[1:]], None
    passing = results[start]
    best = start if passing else 0.0
    rates = walk_rates(start, passing)
    for i, rate in enumerate(rates[1:], 1):
        if rate not in results:
            return rates[i:], None
        ok = results[rate]
        if ok:
            best = max(best, rate)
        if ok != passing:
            break
    return [], best


def full_scale_walks(
    runner: Runner,
    starts: Sequence[float],
    evaluate: Callable[[int, float], dict[str, Any]],
    passed: Callable[[dict[str, Any]], bool],
) -> list[tuple[float, dict[str, Any] | None]]:
    """For walk i from `starts[i]`: (highest passing rate, its result). `evaluate(i, rate)`
    must be picklable (a module-level function) when the runner has processes."""
    results: list[dict[float, dict[str, Any]]] = [{} for _ in starts]
    out: list[tuple[float, dict[str, Any] | None] | None] = [None] * len(starts)
    for i, s in enumerate(starts):
        if s <= 0:
            out[i] = (0.0, None)
    while any(o is None for o in out):
        needs = {}
        for i, s in enumerate(starts):
            if out[i] is not None:
                continue
            todo, best = _advance(s, {r: passed(v) for r, v in results[i].items()})
            if todo:
                needs[i] = todo
            else:
                out[i] = (best or 0.0, results[i].get(best) if best else None)
        if not needs:
            break
        slots = max(1, runner.jobs // len(needs))
        futures = [(i, rate, runner.submit(evaluate, i, rate))
                   for i, todo in needs.items() for rate in todo[:slots]]  # fmt: skip
        for i, rate, fut in futures:
            results[i][rate] = fut.result()
    return [o if o is not None else (0.0, None) for o in out]
