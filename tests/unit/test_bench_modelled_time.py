"""Benchmarks of an emulated cluster in modelled time: arrivals stretched by the time scale,
every measured time divided by it, counts kept."""

from __future__ import annotations

import pytest

from pdserve.bench.modelled_time import stretch_arrivals, time_scale_of, to_modelled
from pdserve.workload.metrics import RequestRecord, summarize
from pdserve.workload.requests import BenchRequest


def test_time_scale_of_up_flags():
    assert time_scale_of(["--mode", "disagg", "--time-scale", "16"]) == 16.0
    assert time_scale_of(["--time-scale=2.5"]) == 2.5
    assert time_scale_of(["--mode", "colocated"]) == 1.0


def test_records_in_modelled_time():
    rec = RequestRecord(index=0, arrival_s=1.0, send_s=1.1, n_in=10, max_tokens=3,
                        token_times=[1.5, 1.9, 2.3], finish_s=2.3, n_out=3,
                        stages={"prefill_ms": 400.0, "transfer_bytes": 64.0,
                                "cached_tokens": 16.0})  # fmt: skip
    (out,), wall = to_modelled([rec], 8.0, 4.0)
    assert wall == 2.0
    assert out.ttft_s == pytest.approx(0.1) and out.tpot_s == pytest.approx(0.1)
    assert out.stages == {"prefill_ms": 100.0, "transfer_bytes": 64.0, "cached_tokens": 16.0}
    assert out.n_out == 3 and out.n_in == 10
    s = summarize([out], wall)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert to_modelled([rec], 8.0, 1.0) == ([rec], 8.0)


def test_arrivals_stretched():
    reqs = [BenchRequest(i, [1], 2, arrival_s=t) for i, t in enumerate((0.0, 0.5))]
    assert [r.arrival_s for r in stretch_arrivals(reqs, 16.0)] == [0.0, 8.0]
