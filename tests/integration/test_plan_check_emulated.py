"""`python -m benchmarks.plan_check` end to end, tiny: `plan` on 2 H100s (2 colocated and
1P1D, the only configurations of M + N <= 2), 24 short requests per rate, each
configuration's goodput searched in the simulator and then on fresh emulated clusters
(`pdserve up --emulate h100 --model-config llama3-8b --time-scale 2`, real processes), at
most 2 emulated runs per configuration. Every emulated run completes every request with the
simulated twin's prompt lengths, the emulated search starts at the simulated answer, and the
verdict and the table name plan's pick."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.integration


def test_plan_check_two_configurations_end_to_end(tmp_path, capsys):
    from benchmarks.plan_check import check as plan_check

    out = tmp_path / "check.json"
    argv = ["--model-config", "llama3-8b", "--hardware", "h100:2", "--max-unit", "2",
            "--chunks", "2048", "--decode-seqs", "256", "--slo", "ttft:300", "tpot:60",
            "--input-len", "lognormal:300,0.6", "--output-len", "uniform:4,24",
            "--num-requests", "24", "--max-model-len", "4096", "--jobs", "1",
            "--start-rate", "8", "--time-scale", "2", "--max-runs", "2", "--out", str(out)]  # fmt: skip
    assert plan_check.main(argv) == 0
    res = json.loads(out.read_text())
    rows = {r["config"]: r for r in res["configs"]}
    assert set(rows) == {"2 colocated", "1P1D"}
    assert res["pick"] in rows
    for r in rows.values():
        assert 1 <= len(r["emu_runs"]) <= 2
        # the emulated search starts from the simulated goodput (or plan's start when 0)
        assert r["emu_points"][0][0] == pytest.approx(r["sim_goodput"] or r["emu_points"][0][0])
        assert r["sim_goodput"] > 0
        for run in r["emu_runs"]:
            assert run["completed"] == run["num_requests"] == 24
            assert run["prompt_tokens_differ"] == 0
            assert run["workers_read"] == 2 and run["step_lag"] is not None
            assert 0.0 <= run["attainment"] <= 1.0
        assert r["emu_goodput"] == max([0.0] + [p for p, a in r["emu_points"] if a >= 0.9])
    v = res["verdict"]
    best = max(rows.values(), key=lambda r: r["emu_per_device"])
    assert v["emulated_best"] == best["config"] and v["pick"] == res["pick"]
    pick_pd, best_pd = rows[res["pick"]]["emu_per_device"], best["emu_per_device"]
    assert v["shortfall"] == pytest.approx(1 - pick_pd / best_pd if best_pd else 0.0)
    printed = capsys.readouterr().out
    assert "plan's pick is within" in printed and "<- plan" in printed
