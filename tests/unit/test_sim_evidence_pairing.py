"""The evidence table's pairing and aggregation: simulated and emulated runs of one seed get
one request list, arms are paired by seed and request digest, gains are paired differences,
and the table prints simulation and emulation side by side. No processes: the runners are
fakes that record what they were given."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.evidence import run as evidence
from benchmarks.evidence.emulated import requests_digest
from benchmarks.evidence.stats import PairingError, arm_stats, merge, setup_rows, table
from pdserve.workload.requests import BenchRequest

SETUP = ("sjf", "lengths", "1P1D", ["--mode", "disagg"], 10.0, 4, "ttft:2000 tpot:60",
         {"fcfs": ["--queue-order=fcfs"], "sjf": ["--queue-order=sjf"],
          "ll": ["--policy=least_loaded"]}, "fcfs")  # fmt: skip


def _reqs(seed: int) -> list[BenchRequest]:
    return [BenchRequest(i, [10 + seed, 11, 12 + i], 5 + i * seed, arrival_s=0.1 * i,
                         prompt_text=f"p{seed}-{i}", oracle_tokens=5 + i * seed)
            for i in range(4)]  # fmt: skip


def _metrics(goodput: float, e2e: float) -> dict:
    return {"goodput": goodput, "attainment": 1.0, "e2e_mean": e2e, "e2e_p99": 2 * e2e,
            "completed": 4, "preemptions": 0, "flips": 0, "tau": None}  # fmt: skip


def test_sim_and_emulated_twins_run_one_request_list(monkeypatch):
    monkeypatch.setattr(evidence, "requests_for", lambda kind, seed, n, rate, tok: _reqs(seed))
    seen: dict[tuple, list] = {}
    gp = {"fcfs": 10.0, "sjf": 12.0, "ll": 10.0}

    def sim(up, reqs, slo):
        arm = next((a for a in ("fcfs", "sjf") if f"--router-arg=--queue-order={a}" in up), "ll")
        seen[("sim", reqs[0].prompt_ids[0], arm)] = reqs
        return _metrics(gp[arm] + reqs[0].prompt_ids[0], 1000.0)

    def emu(up, reqs, slo, name):
        seen[("emu", name)] = (up, reqs)
        return _metrics(0.5 * gp[name.rsplit("_", 1)[1]], 2000.0 + len(up)) | {
            "step_lag": 0.01,
            "send_lag_ms_max": 3.0,
            "prompt_tokens_differ": 0,
            "wall_s": 1.0,
        }

    saved = []
    res = evidence.run_setup(SETUP, [1, 2], lambda m: None, emulate=emu, sim=sim,
                             save=lambda r: saved.append(r))  # fmt: skip
    # one request list per seed, shared by every arm and both sides
    for seed in (1, 2):
        lists = [v for k, v in seen.items() if k[0] == "sim" and k[1] == 10 + seed]
        lists += [v[1] for k, v in seen.items() if k[0] == "emu" and f"_s{seed}_" in k[1]]
        assert len(lists) == 6 and all(x is lists[0] for x in lists)
    # the emulated cluster got the arm's up flags, --policy as up's own flag
    up, _ = seen[("emu", "sjf_lengths_1P1D_s1_ll")]
    assert up == ["--mode", "disagg", "--policy", "least_loaded"]
    assert len(saved) == 2 and saved[0]["rows"][0]["seeds"] == 1  # written after each seed
    rows = {r["arm"]: r for r in res["rows"]}
    assert rows["sjf"]["goodput_gain_pct"][0] == pytest.approx(100 * 2 / 21.5)
    assert rows["sjf"]["emulated"]["goodput_gain_pct"] == pytest.approx((20.0, 0.0))
    assert rows["sjf"]["emulated"]["e2e_mean"][0] == pytest.approx(2000.0 + 3)
    assert rows["sjf"]["emulated"]["step_lag"] == (0.01, 0.01)
    assert (
        "goodput_gain_pct" not in rows["fcfs"]
        and "goodput_gain_pct" not in rows["fcfs"]["emulated"]
    )
    assert rows["fcfs"]["emulated"]["seeds"] == 2


def test_gains_are_paired_per_seed_not_across():
    # a seed effect much larger than the arm effect: the paired CI is tight, means overlap
    base = [dict(_metrics(g, 100.0), seed=s, requests=f"r{s}") for s, g in [(1, 10), (2, 50), (3, 90)]]  # fmt: skip
    arm = [dict(b, goodput=b["goodput"] + 5.0) for b in base]
    st = arm_stats({"base": base, "arm": arm}, "base")
    m, h = st["arm"]["goodput_gain_pct"]
    assert m == pytest.approx(100 * 5 / 50) and h == pytest.approx(0.0)
    assert st["arm"]["goodput"][1] > 20  # the unpaired spread
    assert math.isnan(arm_stats({"base": base[:1]}, "base")["base"]["goodput"][1])


def test_runs_on_different_requests_are_not_paired():
    base = [dict(_metrics(10, 100.0), seed=1, requests="aaa")]
    with pytest.raises(PairingError, match="different requests"):
        arm_stats({"base": base, "arm": [dict(base[0], requests="bbb")]}, "base")
    with pytest.raises(PairingError, match="seeds"):
        arm_stats({"base": base, "arm": [dict(base[0], seed=2)]}, "base")
    # an emulated run must have served its simulated twin's requests
    emu = {"base": [dict(base[0], requests="ccc")]}
    with pytest.raises(PairingError, match="emulated vs simulated"):
        setup_rows({}, "base", {"base": base}, emu)


def test_digest_sees_every_field_that_makes_a_workload():
    a = _reqs(1)
    d = requests_digest(a)
    assert requests_digest(_reqs(1)) == d
    for change in ({"arrival_s": 0.35}, {"max_tokens": 99}, {"prompt_ids": [1, 2]},
                   {"prompt_text": "x"}, {"oracle_tokens": 1}):  # fmt: skip
        b = _reqs(1)
        for k, v in change.items():
            setattr(b[3], k, v)
        assert requests_digest(b) != d, change


def test_table_prints_simulation_and_emulation_side_by_side(tmp_path):
    runs = {a: [dict(_metrics(g + s, 1000.0 * g), seed=s, requests=str(s)) for s in (1, 2, 3)]
            for a, g in (("fcfs", 10.0), ("sjf", 12.0))}  # fmt: skip
    emu = {a: [dict(r, goodput=r["goodput"] / 2, step_lag=0.02) for r in rs]
           for a, rs in runs.items()}  # fmt: skip
    meta = {"group": "sjf", "workload": "lengths", "cluster": "4P4D", "rate": 40.0}
    rows = setup_rows(meta, "fcfs", runs, emu)
    p = tmp_path / "e.json"
    p.write_text(json.dumps({"setups": [{"rows": rows}]}))
    out = table([str(p)])
    side = out.split("\n\n")[1].splitlines()
    assert "goodput gain % sim" in side[0] and "goodput gain % emu" in side[0]
    cells = next(c for line in side if (c := [x.strip() for x in line.split("|")])[4] == "sjf")
    assert cells[5:9] == ["14.00 ± 2.48", "7.00 ± 1.24", "16.7 ± 0.0", "16.7 ± 0.0"]
    assert cells[-2] == "2.0%, 2.0%"


def test_merge_joins_seeds_run_in_parts(tmp_path):
    runs = {a: [dict(_metrics(g + s, 1000.0 * g), seed=s, requests=str(s)) for s in (1, 2, 3)]
            for a, g in (("fcfs", 10.0), ("sjf", 12.0))}  # fmt: skip
    emu = {a: [dict(r, goodput=r["goodput"] / 2) for r in rs] for a, rs in runs.items()}
    meta = {"group": "sjf", "workload": "lengths", "cluster": "4P4D", "rate": 40.0, "n": 4,
            "slo": "ttft:2000"}  # fmt: skip
    whole = setup_rows(meta, "fcfs", runs, emu)
    paths = []
    for part, seeds in (("b", (3, 1)), ("a", (2,))):  # out of order: paired by seed
        r = {a: [x for x in v if x["seed"] in seeds] for a, v in runs.items()}
        e = {a: [x for x in v if x["seed"] in seeds] for a, v in emu.items()}
        p = tmp_path / f"{part}.json"
        p.write_text(json.dumps({"setups": [{"rows": setup_rows(meta, "fcfs", r, e),
                                             "runs": r, "emulated_runs": e}]}))  # fmt: skip
        paths.append(str(p))
    merged = merge(paths)["setups"]
    assert len(merged) == 1 and merged[0]["rows"] == whole
    assert [x["seed"] for x in merged[0]["runs"]["sjf"]] == [1, 2, 3]
