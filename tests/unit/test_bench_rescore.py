"""`bench rescore`: re-scoring saved records under other SLOs."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.rescore import rescore
from pdserve.cli.main import main
from pdserve.workload.goodput import SLO
from pdserve.workload.metrics import RequestRecord


def _record(i: int, ttft_s: float, tpot_s: float, n_out: int = 11) -> dict:
    times = [ttft_s + k * tpot_s for k in range(n_out)]
    return RequestRecord(
        index=i, arrival_s=0.0, send_s=0.0, n_in=10, max_tokens=n_out,
        token_times=times, finish_s=times[-1], n_out=n_out,
    ).to_json()  # fmt: skip


def _result() -> dict:
    # arm "a": every request has TPOT 20 ms; arm "b": TPOT 40 ms at rate 2 (TTFT 0.1 s)
    def run(rate: float, tpot_s: float) -> dict:
        return {"rate": rate, "records": [_record(i, 0.1, tpot_s) for i in range(10)]}

    return {
        "arms": {
            "a": {"sweep": [run(1.0, 0.02), run(2.0, 0.02)]},
            "b": {"sweep": [run(1.0, 0.02), run(2.0, 0.04)]},
        }
    }


def test_rescore_attainment_and_goodput_per_arm():
    loose = rescore(_result(), SLO.parse(["ttft:500", "tpot:50"]), 0.9)
    assert loose["a"]["attainment"] == {1.0: 1.0, 2.0: 1.0}
    assert loose["b"]["distserve"]["max_rate"] == 2.0
    tight = rescore(_result(), SLO.parse(["ttft:500", "tpot:30"]), 0.9)
    assert tight["a"]["distserve"]["max_rate"] == 2.0
    assert tight["b"]["attainment"][2.0] == pytest.approx(0.0)
    assert tight["b"]["distserve"]["max_rate"] == 1.0


def test_rescore_cli_prints_each_slo_set(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_result()))
    cmd = ["bench", "rescore", str(path), "--goodput", "ttft:500", "tpot:30"]
    assert main([*cmd, "--goodput", "ttft:500", "tpot:50"]) == 0
    out = capsys.readouterr().out
    assert "SLO ttft:500 tpot:30" in out and "SLO ttft:500 tpot:50" in out
