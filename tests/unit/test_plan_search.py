"""`pdserve plan` end to end on a tiny search: the same answer with 1 or 2 processes, the
no-chunk colocated baseline, and the parallel full-scale walk equal to the sequential one."""

from __future__ import annotations

import argparse

import pytest

from pdserve.bench.serve import add_workload_args
from pdserve.sim import parallel
from pdserve.sim.plan import NOCHUNK, Budget, plan


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
def test_plan_is_the_same_with_more_processes(jobs):
    budget = Budget.parse("h100:4")
    one = plan(_args(), budget, "llama3-8b", log=lambda m: None)
    many = plan(_args(jobs=jobs), budget, "llama3-8b", log=lambda m: None)
    assert _strip(one) == _strip(many)
    assert set(one["best"]) == {"colocated", NOCHUNK, "disagg"}
    assert one["disagg_over_colocated_nochunk_per_device"] is not None
    assert all(b["goodput_req_s"] > 0 for b in one["best"].values())


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
