"""`python -m benchmarks.evidence --emulate` end to end, small: one seed, two arms (FCFS and SJF with
the online predictor behind a router queue) of 20 real Arena prompts on an emulated 1P1D
whose pools model different hardware (`pdserve up --emulate prefill=h100,decode=l40s
--model-config llama3-8b --time-scale 1`, real processes; each worker's KV blocks follow its
own), each arm also simulated on the same request list (the same hardware per pool). Both sides complete every request, the emulated
router tokenized every prompt to the simulated twin's length, the workers' counters were read,
and each row carries the simulated and the emulated statistics."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

LENGTHS = Path("/work/shared/data/lengths/arena_train_val.jsonl.gz")


@pytest.mark.skipif(not LENGTHS.exists(), reason="the length data is not on this machine")
def test_one_seed_two_arms_simulated_and_emulated(tmp_path, monkeypatch):
    from benchmarks.evidence import run as evidence
    from benchmarks.evidence.emulated import EmuOptions, emulated_arm, tokenizer_dir
    from pdserve.costmodel.roofline import roofline_costs

    monkeypatch.setattr(evidence, "LENGTH_SCALE", [0.05])  # answers of ~10-200 tokens
    q = "--queue-max-running-per-decode=2"
    # each pool its own hardware: an H100 prefill, an L40S decode
    cluster = ["--mode", "disagg", "--prefill", "1", "--decode", "1",
               "--emulate", "prefill=h100,decode=l40s"]  # fmt: skip
    setup = ("sjf", "lengths", "1P1D", cluster, 10.0, 20, "ttft:2000 tpot:60",
             {"fcfs": [evidence.LEN, q, "--queue-order=fcfs"],
              "sjf online": [evidence.LEN, q, "--queue-order=sjf"]}, "fcfs")  # fmt: skip
    opt = EmuOptions(time_scale=1.0, log_dir=tmp_path, ready_timeout_s=240.0)
    emu_runs: list[dict] = []

    def emulate(up, reqs, slo, name):
        emu_runs.append(emulated_arm(up, reqs, slo, opt, name))
        return emu_runs[-1]

    res = evidence.run_setup(setup, [1], print, emulate=emulate, tokenizer=tokenizer_dir(opt))

    for runs in (res["runs"], res["emulated_runs"]):
        assert [r["completed"] for a in ("fcfs", "sjf online") for r in runs[a]] == [20, 20]
    h100, l40s = (roofline_costs("llama3-8b", hw) for hw in ("h100", "l40s"))
    for e in emu_runs:
        assert e["prompt_tokens_differ"] == 0  # the router's token counts = the twin's
        blocks = sorted(e["kv_blocks"].values())  # the L40S decode holds less KV
        assert blocks == [l40s.kv_capacity_bytes // (16 * l40s.kv_bytes_per_token),
                          h100.kv_capacity_bytes // (16 * h100.kv_bytes_per_token)]  # fmt: skip
        assert e["workers_read"] == 2 and e["step_lag"] is not None and e["step_lag"] >= 0
        assert e["tau"] is None or -1 <= e["tau"] <= 1
    # same seed, same requests: simulated and emulated twins carry one digest
    digests = {r["requests"] for side in ("runs", "emulated_runs") for rs in res[side].values()
               for r in rs}  # fmt: skip
    assert len(digests) == 1
    rows = {r["arm"]: r for r in res["rows"]}
    for arm, row in rows.items():
        for side in (row, row["emulated"]):
            assert side["goodput"][0] >= 0 and side["e2e_mean"][0] > 0
            assert math.isnan(side["goodput"][1])  # one seed: no interval
        assert ("goodput_gain_pct" in row["emulated"]) == (arm != "fcfs")
    assert (tmp_path / "sjf_lengths_1P1D_s1_fcfs_up.log").exists()
