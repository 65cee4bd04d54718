"""A plan's simulations on several processes, with the sequential answer.

Each simulation is a pure function of its inputs, so running independent ones on `jobs`
forked processes changes only the wall time. The shared inputs (the parsed trace, the
candidates, the SLOs) are put in `CONTEXT` before the pool forks, so each task carries only
an index and a rate, and no worker re-reads the trace.

The work is a set of sequential *searches* over rates (a unit's goodput search, a
full-scale 10 % walk), each a function `need(known)` from the outcomes known so far to the
next rate it evaluates. `Scheduler` runs every search's needed point as soon as a process is
free (points, not whole searches, are the tasks, so the processes stay busy to the end), and
fills processes no search needs with speculative points: the point a search would need next
if its points in flight came out as guessed. A search's visited rates, hence its answer, are
those of the sequential search whatever the guesses; a wrong guess only wastes a process.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

CONTEXT: dict[str, Any] = {}  # set before the pool forks; read by the tasks in the workers
STEP = 1.1
MAX_STEPS = 3


class Runner:
    """`jobs` forked processes (or this process when jobs == 1). Tasks are submitted one per
    free process; `close` stops workers still running a point nobody needs any more. A
    worker that dies breaks the pool (`BrokenProcessPool` from `wait`), it does not hang it."""

    def __init__(self, jobs: int) -> None:
        self.jobs = max(1, jobs)
        self._pool: ProcessPoolExecutor | None = None
        self._futures: dict[Future, int] = {}
        self._next = 0
        if self.jobs > 1:
            ctx = multiprocessing.get_context("fork")
            self._pool = ProcessPoolExecutor(self.jobs, mp_context=ctx)

    def submit(self, fn: Callable[..., Any], *args: Any) -> int:
        """Start `fn(*args)`; returns a ticket that `wait` hands back with the result."""
        ticket, self._next = self._next, self._next + 1
        if self._pool is None:
            fut: Future = Future()
            fut.set_result(fn(*args))
        else:
            fut = self._pool.submit(fn, *args)
        self._futures[fut] = ticket
        return ticket

    def wait(self) -> tuple[int, Any]:
        """(ticket, result) of a finished task (the first submitted of those finished);
        re-raises a task's exception."""
        done, _ = wait(list(self._futures), return_when=FIRST_COMPLETED)
        fut = min(done, key=lambda f: self._futures[f])
        return self._futures.pop(fut), fut.result()

    def close(self) -> None:
        if self._pool is not None:
            # the executor's worker processes (a private attribute; nothing else lists them)
            procs = list((getattr(self._pool, "_processes", None) or {}).values())
            self._pool.shutdown(wait=False, cancel_futures=True)
            for p in procs:  # only unneeded speculative points can still be running
                p.terminate()
            for p in procs:
                p.join()
            self._pool = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@dataclass(eq=False)
class Search:
    """One sequential search. `need(known)`: the next rate to evaluate given `known` (rate ->
    attainment), None when the search is over. `fn(*args, rate)` evaluates a rate (a
    module-level function when the runner has processes) and returns a dict whose
    'attainment' the search reads. `priority`: higher runs first."""

    name: str
    need: Callable[[Mapping[float, float]], float | None]
    fn: Callable[..., dict[str, Any]]
    args: tuple[Any, ...]
    target: float
    priority: float = 0.0
    results: dict[float, dict[str, Any]] = field(default_factory=dict)
    known: dict[float, float] = field(default_factory=dict)
    done: bool = False
    eager: bool = False  # speculate ahead even while other searches need processes
    optimistic: bool = False  # guess that every point in flight passes (a 10 % walk)

    def path(self) -> list[float]:
        """The rates the sequential search has visited so far, in its order (speculative
        points it has not reached yet, or never will, left out)."""
        seen: dict[float, float] = {}
        while (rate := self.need(seen)) is not None and rate in self.known:
            seen[rate] = self.known[rate]
        return list(seen)

    def guess(self, rate: float) -> bool:
        """The guessed outcome of a rate in flight (for speculation only): the linear
        crossing of the target between the highest known pass and the lowest known fail;
        with only passes known, a pass; with only fails, a fail. `optimistic`: a pass (a
        walk then speculates only upwards, and a walk coming down stops at a pass)."""
        if self.optimistic:
            return True
        passes = [r for r, a in self.known.items() if a >= self.target]
        fails = [r for r, a in self.known.items() if a < self.target]
        if not fails:
            return True
        if not passes:
            return False
        lo, hi = max(passes), min(fails)
        a_lo, a_hi = self.known[lo], self.known[hi]
        cross = hi if a_lo <= a_hi else lo + (a_lo - self.target) / (a_lo - a_hi) * (hi - lo)
        return rate <= cross


def _score(res: dict[str, Any]) -> float:
    return float(res.get("attainment") or 0.0)


class Scheduler:
    """Runs searches on a `Runner`; `on_result(search)` after each result may add
    searches (`add`), e.g. a full-scale walk once its unit is known."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.searches: list[Search] = []
        self.submitted = 0

    def add(self, search: Search) -> None:
        self.searches.append(search)

    def _refresh(self) -> list[tuple[Search, float]]:
        """Needed (search, rate) pairs, highest priority first; marks finished searches."""
        out = []
        for s in sorted(self.searches, key=lambda s: -s.priority):
            if s.done:
                continue
            rate = s.need(s.known)
            if rate is None:
                s.done = True
            else:
                out.append((s, rate))
        return out

    def _picks(self, free: int, flying: list[tuple[Search, float]]) -> list[tuple[Search, float]]:
        busy = {(id(s), r) for s, r in flying}
        needed = [(s, r) for s, r in self._refresh() if (id(s), r) not in busy]
        # eager searches (a long sequential chain: the critical path) take their needed point
        # and then speculative ones before other searches' needed points
        picks = [(s, r) for s, r in needed if s.eager][:free]
        eager = [s for s in sorted(self.searches, key=lambda s: -s.priority)
                 if s.eager and not s.done]  # fmt: skip
        self._speculate(free, flying, picks, busy, eager)
        picks += [(s, r) for s, r in needed if not s.eager][: max(0, free - len(picks))]
        live = [s for s in sorted(self.searches, key=lambda s: -s.priority) if not s.done]
        self._speculate(free, flying, picks, busy, live)
        return picks

    def _speculate(
        self,
        free: int,
        flying: list[tuple[Search, float]],
        picks: list[tuple[Search, float]],
        busy: set[tuple[int, float]],
        live: list[Search],
    ) -> None:
        """Add to `picks`, up to `free`, per search of `live` (round robin) the rate it would
        need next if its points in flight (or just picked) came out as guessed."""
        for s, r in picks:
            busy.add((id(s), r))
        hyps = {
            id(s): dict(s.known) | {r: float(s.guess(r)) for t, r in flying + picks if t is s}
            for s in live
        }
        live = list(live)
        while len(picks) < free and live:
            for s in list(live):
                if len(picks) >= free:
                    break
                hyp = hyps[id(s)]
                rate = s.need(hyp)
                if rate is None or (id(s), rate) in busy:
                    live.remove(s)
                    continue
                picks.append((s, rate))
                busy.add((id(s), rate))
                hyp[rate] = float(s.guess(rate))

    def run(self, on_result: Callable[[Search], None] | None = None) -> None:
        flying: dict[int, tuple[Search, float]] = {}
        while True:
            free = self.runner.jobs - len(flying)
            if free > 0:
                for s, rate in self._picks(free, list(flying.values())):
                    flying[self.runner.submit(s.fn, *s.args, rate)] = (s, rate)
                    self.submitted += 1
            if all(s.done for s in self.searches) or not flying:
                return  # answered (points still in flight are unneeded speculation)
            ticket, res = self.runner.wait()
            s, rate = flying.pop(ticket)
            s.results[rate] = res  # a speculative one too: a later need may ask for it
            s.known[rate] = _score(res)
            if on_result is not None:
                on_result(s)
            self._refresh()

    @property
    def wasted(self) -> int:
        """Points evaluated that no sequential search visits (speculation that missed)."""
        return self.submitted - sum(len(s.path()) for s in self.searches)


# ---- the full-scale 10 % walk ---------------------------------------------------------


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


def walk_need(start: float, target: float) -> Callable[[Mapping[float, float]], float | None]:
    """`need` of `refine`'s 10 % walk from `start` (up while it passes, down while it fails,
    at most MAX_STEPS steps)."""

    def need(known: Mapping[float, float]) -> float | None:
        if start <= 0:
            return None
        todo, _ = _advance(start, {r: a >= target for r, a in known.items()})
        return todo[0] if todo else None

    return need


def walk_answer(start: float, s: Search | None) -> tuple[float, dict[str, Any] | None]:
    """(highest passing rate of a finished walk, its result); (0, None) for no walk."""
    if s is None or start <= 0:
        return 0.0, None
    _, best = _advance(start, {r: a >= s.target for r, a in s.known.items()})
    return (best or 0.0), (s.results.get(best) if best else None)


def full_scale_walks(
    runner: Runner,
    starts: Sequence[float],
    evaluate: Callable[[int, float], dict[str, Any]],
    passed: Callable[[dict[str, Any]], bool],
) -> list[tuple[float, dict[str, Any] | None]]:
    """For walk i from `starts[i]`: (highest passing rate, its result). `evaluate(i, rate)`
    must be picklable (a module-level function) when the runner has processes."""
    sched = Scheduler(runner)
    walks = []
    for i, s in enumerate(starts):
        w = Search(f"walk {i}", walk_need(s, 0.5), _scored, (evaluate, passed, i), 0.5)
        walks.append(w)
        sched.add(w)
    sched.run()
    out = []
    for s, w in zip(starts, walks, strict=True):
        best, res = walk_answer(s, w)
        out.append((best, res["result"] if res is not None else None))
    return out


def _scored(evaluate: Callable, passed: Callable, i: int, rate: float) -> dict[str, Any]:
    res = evaluate(i, rate)
    return {"attainment": 1.0 if passed(res) else 0.0, "result": res}
