"""End to end: `pdserve up` on a tiny checkpoint, a few seconds of open-loop load through the
SDK, and the JSON result + PNG plots `bench serve` writes."""

from __future__ import annotations

import argparse
import importlib.util
import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

if importlib.util.find_spec("pdserve.cli.up") is None:
    pytest.skip(
        "pdserve.cli.up (the `pdserve up` launcher) does not exist yet", allow_module_level=True
    )

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from pdserve.model.tiny import TinySpec, make_tiny

    return make_tiny(tmp_path_factory.mktemp("bench-tiny"), TinySpec(vocab=512, max_pos=512))


def test_bench_serve_against_a_real_cluster(tiny_model, tmp_path):
    from pdserve.bench import serve
    from pdserve.bench.cluster import UpProcess

    out = tmp_path / "run.json"
    p = argparse.ArgumentParser()
    serve.add_parser(p.add_subparsers())
    cluster = UpProcess(
        ["--model", str(tiny_model), "--mode", "colocated", "--colocated", "1"],
        port=0,
        ready_timeout_s=240,
        log_path=tmp_path / "up.log",
    )
    with cluster as addr:
        args = p.parse_args(
            [
                "serve",
                "--addr",
                addr,
                "--model",
                str(tiny_model),
                "--num-requests",
                "8",
                "--rate",
                "4",
                "--input-len",
                "uniform:8,40",
                "--output-len",
                "fixed:6",
                "--goodput",
                "ttft:60000",
                "tpot:60000",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        assert args.func(args) == 0

    data = json.loads(out.read_text())
    summary = data["summary"]
    assert summary["completed"] == 8, summary["errors"]
    records = data["sweep"][0]["records"]
    assert all(r["n_out"] == 6 and len(r["token_times"]) == 6 for r in records)
    assert all(r["ttft_s"] > 0 and r["e2e_s"] >= r["ttft_s"] for r in records)
    assert all(r["stages"] for r in records), "usage.stages missing from the final response"
    assert summary["ttft_ms"]["p50"] is not None and summary["tpot_ms"]["p99"] is not None
    assert data["goodput"]["vllm_req_s"] > 0
    for name in ("cdf_ttft.png", "cdf_tpot.png", "cdf_e2e.png"):
        assert (tmp_path / "run_plots" / name).read_bytes()[:8] == PNG_MAGIC
