"""`plan --map`: the grid, rescoring one run for every cell, and the shared search giving
each cell the answer `plan` gives under that cell's SLOs, with fewer runs."""

from __future__ import annotations

import argparse

import pytest

from pdserve.sim import parallel
from pdserve.sim.candidates import NOCHUNK, Budget, candidates
from pdserve.sim.plan import plan
from pdserve.sim.slo_map import GROUPS, Grid, MapSearch, group_of, score_cells, slo_map
from pdserve.workload.goodput import SLO, attainment, distserve_goodput, search_goodput_rate
from pdserve.workload.metrics import RequestRecord
from pdserve.workload.spec import add_workload_args


def test_grid_parses_sorts_and_names_its_loosest_cell():
    g = Grid.parse("1000,100,250", "50,20")
    assert g.ttft_ms == (100.0, 250.0, 1000.0) and g.tpot_ms == (20.0, 50.0)
    cells = g.cells()
    assert len(cells) == 6 and cells[0] == SLO(ttft_ms=100.0, tpot_ms=20.0)
    assert cells[1] == SLO(ttft_ms=100.0, tpot_ms=50.0)  # row-major: TTFT rows
    assert g.loosest() == SLO(ttft_ms=1000.0, tpot_ms=50.0)


@pytest.mark.parametrize("ttft,tpot", [("", "20"), ("100,x", "20"), ("100", "0"), ("-5", "20")])
def test_grid_refuses_bad_values_naming_the_flag(ttft, tpot):
    with pytest.raises(ValueError, match="--map-t"):
        Grid.parse(ttft, tpot)


def _record(i: int, ttft_s: float, tpot_s: float, n_out: int = 11) -> RequestRecord:
    times = [ttft_s + k * tpot_s for k in range(n_out)]
    return RequestRecord(i, 0.0, 0.0, 100, n_out, token_times=times, finish_s=times[-1],
                         n_out=n_out)  # fmt: skip


def test_one_run_rescored_for_every_cell_is_each_cells_attainment():
    recs = [_record(i, 0.05 * (i % 7), 0.01 * (i % 5)) for i in range(40)]
    recs.append(RequestRecord(40, 0.0, 0.0, 100, 10, error="boom"))  # a failure meets none
    cells = Grid.parse("100,200,400", "20,30,50").cells()
    got = score_cells(recs, cells)
    assert got == [attainment(recs, c) for c in cells]
    # a looser cell never attains less: a run that fails the loosest fails them all
    for k, c in enumerate(cells):
        for m, d in enumerate(cells):
            if d.ttft_ms >= c.ttft_ms and d.tpot_ms >= c.tpot_ms:
                assert got[m] >= got[k]


def _cands():
    return candidates(Budget.parse("h100:4"), "llama3-8b", "nvlink", "bfloat16", [512, 2048],
                      [256], 3, colocated_modes="chunked,nochunk", nochunk_budgets=[2048])  # fmt: skip


def _capacity(i: int, reps: int, slo: SLO) -> float:
    """A fake unit's capacity (req/s) under `slo`: grows with both SLOs, differs per unit."""
    return reps * (3.0 + 1.7 * (i % 5)) * (slo.ttft_ms / 100) ** 0.5 * (slo.tpot_ms / 20) ** 0.3


def _fake_evaluate(cells, calls):
    def evaluate(points):
        calls.extend(points)
        return [{"attainment": [1.0 if rate <= _capacity(i, reps, c) else 0.5 for c in cells],
                 "out_tokens": 100.0} for i, reps, rate in points]  # fmt: skip

    return evaluate


def _plan_cell(cands, budget, slo, start_rate):
    """`plan`'s answer under one SLO, run the slow way: every unit's search, the best unit per
    group, its 10 % walk at full scale (the fake capacities above)."""
    best = {}
    for group in GROUPS:
        units = []
        for i, c in enumerate(cands):
            if group_of(c) != group:
                continue
            pts = search_goodput_rate(lambda r, i=i: 1.0 if r <= _capacity(i, 1, slo) else 0.5,
                                      start_rate * c.num_devices, 0.9, 10, 3)  # fmt: skip
            rate = distserve_goodput(pts, 0.9)["max_rate"] or 0.0
            units.append((rate / c.num_devices, i, rate))
        top = max(units, key=lambda u: u[0])  # max keeps the first of equals
        _, i, rate = top
        reps = min(budget.devices[hw] // n for hw, n in cands[i].devices().items())
        walk = parallel.Search("w", parallel.walk_need(rate * reps, 0.9), None, (), 0.9)
        while (r := walk.need(walk.known)) is not None:
            walk.known[r] = 1.0 if r <= _capacity(i, reps, slo) else 0.5
        full, _ = parallel.walk_answer(rate * reps, walk)
        best[group] = (cands[i].label, full / (cands[i].num_devices * reps))
    return best


def test_shared_search_gives_each_cell_plans_answer_with_fewer_runs():
    cands, budget = _cands(), Budget.parse("h100:4")
    cells = Grid.parse("100,250,1000", "20,50,100").cells()
    calls: list = []
    search = MapSearch(cands, budget, cells, 4.0, 0.9)
    n = search.run(_fake_evaluate(cells, calls))
    assert n == len(calls) == len(set(calls))  # every point run once
    for k, slo in enumerate(cells):
        res = search.cell_result(k)
        want = _plan_cell(cands, budget, slo, 4.0)
        for group in GROUPS:
            assert (res[group]["unit"], res[group]["per_device_goodput"]) == pytest.approx(
                want[group]), (slo, group)  # fmt: skip
        assert res["ratio"] == pytest.approx(
            res["disagg"]["per_device_goodput"] / res["colocated"]["per_device_goodput"]
        )
    assert n < search.points_per_cell()  # cells share runs


def _args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_workload_args(p)
    a = p.parse_args(["--duration", "1", "--vocab-size", "1000", "--input-len",
                      "lognormal:300,0.6", "--output-len", "uniform:10,60",
                      "--max-model-len", "4096"])  # fmt: skip
    a.chunks, a.decode_seqs, a.max_unit, a.start_rate = "2048", "128", 2, 8.0
    a.colocated_modes, a.jobs = "chunked,nochunk", 1
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_map_of_real_runs_equals_plan_under_each_cells_slos():
    budget = Budget.parse("h100:2")
    cands = candidates(budget, "llama3-8b", "nvlink", "bfloat16", [2048], [128], 2,
                       colocated_modes="chunked,nochunk")  # fmt: skip
    grid = Grid.parse("150,600", "40")
    res = slo_map(_args(), budget, cands, grid, 4096, log=lambda m: None)
    assert res["runs"] < res["runs_cell_by_cell"]
    for cell in res["cells"]:
        slo = [f"ttft:{cell['ttft_ms']:g}", f"tpot:{cell['tpot_ms']:g}"]
        p = plan(_args(goodput=slo), budget, "llama3-8b", log=lambda m: None)
        colo = max((p["best"][k] for k in ("colocated", NOCHUNK)),
                   key=lambda b: b["unit_per_device_goodput"])  # fmt: skip
        assert cell["colocated"]["unit"] == colo["unit"]
        assert cell["colocated"]["per_device_goodput"] == colo["per_device_goodput"]
        assert cell["disagg"]["per_device_goodput"] == p["best"]["disagg"]["per_device_goodput"]
        assert cell["ratio"] == pytest.approx(p["best"]["disagg"]["per_device_goodput"]
                                              / colo["per_device_goodput"])  # fmt: skip


def test_budget_with_tp_alternatives_tries_each_tp_per_pool():
    b = Budget.parse("h100x4/8:16")
    assert b.devices == {"h100": 16} and b.instance_specs() == ["h100x4", "h100x8"]
    cands = candidates(b, "llama3-70b", "nvlink", "bfloat16", [2048], [256], 2)
    pools = {(c.kind, c.hw_prefill, c.hw_decode) for c in cands}
    assert ("colocated", "h100x4", "h100x4") in pools and ("colocated", "h100x8", "h100x8") in pools
    assert {("disagg", p, d) for p in ("h100x4", "h100x8") for d in ("h100x4", "h100x8")} <= pools
    assert all(c.num_devices <= 16 for c in cands)
    with pytest.raises(ValueError, match="NAME"):
        Budget.parse("h100x4/y:8")
