"""`pdserve plan` end to end on a tiny search: the same answer with 1 or 2 processes and as
the sequential search, the no-chunk colocated baseline, the point scheduler's searches visiting
the sequential rates, the walk started early only on the decided best unit, and the lazy
trace window equal to `workload_at`'s."""

from __future__ import annotations

import argparse
import math

import pytest

from pdserve.sim import parallel, plan_search, run
from pdserve.sim.candidates import NOCHUNK, Budget, candidates, latency_at
from pdserve.sim.plan import plan, unit_goodput
from pdserve.sim.plan_search import BISECT_STEPS, MAX_STEPS, sweep_need
from pdserve.workload.goodput import SLO, search_goodput_rate
from pdserve.workload.spec import add_workload_args, workload_at


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    p.add_argument("--slo", dest="goodput", nargs="*")
    a = p.parse_args(["--slo", "ttft:300", "tpot:60", "--duration", "2", "--vocab-size", "1000",
                      "--input-len", "lognormal:300,0.6", "--output-len", "uniform:10,60",
                      "--max-model-len", "4096"])  # fmt: skip
    a.chunks, a.decode_seqs, a.max_unit, a.start_rate = "2048", "128", 2, 8.0
    a.colocated_modes, a.jobs = "chunked,nochunk", 1
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def _strip(res):
    return {k: v for k, v in res.items() if k not in ("wall_s", "cpu_s")}


@pytest.mark.parametrize("jobs", [2])
def test_plan_is_the_same_with_more_processes_and_as_the_sequential_search(jobs):
    budget = Budget.parse("h100:4")
    one = plan(_args(), budget, "llama3-8b", log=lambda m: None)
    many = plan(_args(jobs=jobs), budget, "llama3-8b", log=lambda m: None)
    assert _strip(one) == _strip(many)
    assert set(one["best"]) == {"colocated", NOCHUNK, "disagg"}
    assert one["disagg_over_colocated_nochunk_per_device"] is not None
    assert all(b["goodput_req_s"] > 0 for b in one["best"].values())
    _check_sequential(many, _args(), budget)


def _sequential(start, passes):
    """`refine`'s walk as it was written: one point at a time."""
    best = 0.0
    ok0 = passes(start)
    if ok0:
        best = start
    step, rate = (1.1 if ok0 else 1 / 1.1), start
    for _ in range(3):
        rate *= step
        ok = passes(rate)
        if ok:
            best = max(best, rate)
        if ok != ok0:
            break
    return best


@pytest.mark.parametrize("jobs", [1, 3])
@pytest.mark.parametrize("capacity", [5.0, 9.0, 10.5, 11.9, 13.5, 20.0])
def test_parallel_walk_finds_the_sequential_answer(capacity, jobs):
    starts = [10.0, 12.0, 0.0]
    with parallel.Runner(1) as runner:
        runner.jobs = jobs  # speculative batches, evaluated in this process
        seen: list[float] = []

        def evaluate(i, rate):
            seen.append(rate)
            return {"ok": rate <= capacity}

        got = parallel.full_scale_walks(runner, starts, evaluate, lambda r: r["ok"])
    for s, (best, res) in zip(starts, got, strict=True):
        want = _sequential(s, lambda r: r <= capacity) if s > 0 else 0.0
        assert best == want
        assert (res is None) == (best == 0.0)


# ---- the point scheduler keeps each search's sequential rates -------------------------


def _attainment(cap: float, wobble: float):
    """A made-up attainment curve: ~1 well below `cap`, falling through the target near it,
    with a deterministic wobble (non-monotone, like a simulation's)."""

    def f(rate: float) -> float:
        base = 1.0 / (1.0 + (rate / cap) ** 8)
        return min(1.0, max(0.0, base + wobble * math.sin(rate * 7.3)))

    return f


def _fake_point(curve_id: int, rate: float) -> dict:
    return {"attainment": _CURVES[curve_id](rate), "out_tokens": None}


_CURVES = [_attainment(c, w) for c, w in [(3.0, 0.0), (17.0, 0.05), (40.0, 0.1), (150.0, 0.0),
                                            (0.01, 0.0), (9.5, 0.2)]]  # fmt: skip


@pytest.mark.parametrize("jobs", [1, 2, 3, 5])
def test_scheduler_visits_the_sequential_rates(jobs):
    target = 0.9
    with parallel.Runner(1) as runner:
        runner.jobs = jobs  # speculative points, evaluated in this process
        sched = parallel.Scheduler(runner)
        searches = []
        for k, start in enumerate([8.0, 8.0, 16.0, 8.0, 8.0, 24.0]):
            s = parallel.Search(f"s{k}", sweep_need(start, target), _fake_point, (k,), target,
                                priority=k % 3)  # fmt: skip
            searches.append((s, start, k))
            sched.add(s)
        sched.run()
    for s, start, k in searches:
        want = search_goodput_rate(_CURVES[k], start, target, MAX_STEPS, BISECT_STEPS)
        assert s.path() == [p.rate for p in want]
        assert [s.known[r] for r in s.path()] == [p.attainment for p in want]
    if jobs == 1:
        assert sched.wasted == 0  # one process: nothing speculative


def test_lazy_trace_window_is_workload_at(tmp_path):
    trace = tmp_path / "t.csv"
    rows = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    rows += [f"{0.37 * i + (i % 5) * 0.11:.4f},{50 + 13 * i % 400},{1 + 7 * i % 90}"
             for i in range(300)]  # fmt: skip
    trace.write_text("\n".join(rows) + "\n")
    args = _args(trace=str(trace), duration=3.0)
    for rate in (0.5, 4.0, 37.0, 1000.0):  # 1000 req/s: every record
        got = run.sim_workload(args, rate, 0)
        want = workload_at(args, rate, 0)
        assert got == want and got
    args.duration = None
    assert run.sim_workload(args, 5.0, 0) == workload_at(args, 5.0, 0)


def _check_sequential(got, args, budget):
    """Units searched one after the other with `unit_goodput` (the sequential search) and the
    full-scale walk one point at a time give the answer the point scheduler gave."""
    slo = SLO.parse(args.goodput)
    mml = args.max_model_len
    cands = candidates(budget, "llama3-8b", "nvlink", "bfloat16", [2048], [128], 2,
                       colocated_modes="chunked,nochunk")  # fmt: skip
    units = [unit_goodput(c, args, slo, mml, 0.9, 8.0 * c.num_devices) for c in cands]
    for u, g in zip(units, got["units"], strict=True):
        assert (u["label"], u["goodput_req_s"], u["points"], u["mean_output_tokens"]) == (
            g["label"], g["goodput_req_s"], [tuple(p) for p in g["points"]],
            g["mean_output_tokens"])  # fmt: skip
    for kind, b in got["best"].items():
        pool = [(u, c) for u, c in zip(units, cands, strict=True) if c.kind == kind]
        u, c = max(pool, key=lambda uc: uc[0]["per_device_goodput"])
        assert b["unit"] == u["label"]
        reps = b["replicas"]
        start = u["goodput_req_s"] * reps

        def passes(rate, c=c, reps=reps):
            return (latency_at(c, reps, args, slo, mml, rate)["attainment"] or 0.0) >= 0.9

        assert b["goodput_req_s"] == _sequential(start, passes)


def test_walk_starts_once_the_best_unit_is_decided(monkeypatch):
    """The walk of a kind may start while other units still search, but only on the unit
    that `max` over all the finished units picks (the first of equal per-device goodputs)."""
    budget = Budget.parse("h100:8")
    cands = candidates(budget, "llama3-8b", "nvlink", "bfloat16", [2048], [128], 4)
    caps = {i: 9.0 * c.num_devices * (1.0 if i % 3 else 1.3) for i, c in enumerate(cands)}
    curves = {i: _attainment(caps[i], 0.0) for i in caps}
    monkeypatch.setattr(plan_search, "_point_task",
                        lambda i, rate: {"attainment": curves[i](rate), "out_tokens": 100.0})  # fmt: skip
    monkeypatch.setattr(plan_search, "_full_task",
                        lambda i, reps, rate: {"attainment": curves[i](rate / reps)})  # fmt: skip
    for jobs in (1, 2, 4):
        events: list[str] = []
        with parallel.Runner(1) as runner:
            runner.jobs = jobs
            ps = plan_search.PlanSearch(runner, cands, budget, 8.0, 0.9, ["colocated", "disagg"],
                                        events.append)  # fmt: skip
            ps.run()
        units = ps.units
        for kind, (top, _, _start, walk) in ps.walks.items():
            pool = [u for u, c in zip(units, cands, strict=True) if c.kind == kind]
            assert top is max(pool, key=lambda u: u["per_device_goodput"])
            assert walk is not None and walk.path()
        if jobs == 4:  # the disagg walk started before the last unit answered
            first_walk = next(i for i, e in enumerate(events) if e.startswith("best disagg"))
            assert first_walk < max(i for i, e in enumerate(events) if e.startswith("  ["))
