"""Metrics and goodput on hand-made timelines."""

from __future__ import annotations

import random

import pytest

from pdserve.workload.goodput import (
    SLO,
    SweepPoint,
    attainment,
    distserve_goodput,
    meets,
    search_goodput_rate,
    vllm_goodput,
)
from pdserve.workload.metrics import RequestRecord, itl_stats_ms, stats_ms, summarize


def rec(i: int, send: float, times: list[float], n_in: int = 10, **kw) -> RequestRecord:
    return RequestRecord(
        index=i,
        arrival_s=send,
        send_s=send,
        n_in=n_in,
        max_tokens=len(times),
        token_times=times,
        finish_s=times[-1] if times else None,
        n_out=len(times),
        **kw,
    )


def test_per_request_ttft_tpot_itl_e2e():
    r = rec(0, 1.0, [1.5, 1.6, 1.8, 2.1])
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    assert r.tpot_s == pytest.approx((1.1 - 0.5) / 3)
    assert r.itls_s == pytest.approx([0.1, 0.2, 0.3])


def test_single_token_has_no_tpot_and_failed_has_nothing():
    assert rec(0, 0.0, [0.2]).tpot_s is None
    bad = rec(1, 0.0, [0.2, 0.3], error="Unavailable: boom")
    assert not bad.ok and bad.ttft_s is None and bad.itls_s == []


def test_percentiles_known_values():
    # TTFTs 100, 200, ..., 1000 ms -> p50 550, p90 910, p99 991 (linear interpolation)
    records = [rec(i, 0.0, [0.1 * (i + 1), 0.1 * (i + 1) + 0.05]) for i in range(10)]
    s = summarize(records, duration_s=2.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(550)
    assert s["ttft_ms"]["p90"] == pytest.approx(910)
    assert s["ttft_ms"]["p99"] == pytest.approx(991)
    assert s["ttft_ms"]["mean"] == pytest.approx(550)
    assert s["tpot_ms"]["p50"] == pytest.approx(50)
    assert s["itl_ms"]["count"] == 10
    assert s["request_throughput"] == pytest.approx(5.0)
    assert s["input_token_throughput"] == pytest.approx(50.0)
    assert s["output_token_throughput"] == pytest.approx(10.0)


def test_summary_counts_failures_and_stage_costs():
    ok = rec(
        0,
        0.0,
        [0.1, 0.2],
        cached_tokens=4,
        stages={
            "prefill_ms": 30.0,
            "decode_ms": 70.0,
            "transfer_ms": 5.0,
            "transfer_bytes": 1024.0,
            "queue_ms": 1.0,
        },
    )
    ok2 = rec(1, 0.0, [0.1, 0.3], stages={"prefill_ms": 10.0, "decode_ms": 30.0})
    bad = rec(2, 0.0, [], error="Internal: x")
    s = summarize([ok, ok2, bad])
    assert (s["completed"], s["failed"]) == (2, 1)
    assert s["duration_s"] == pytest.approx(0.3)
    assert s["cache_hit_rate"] == pytest.approx(4 / 20)
    st = s["stages"]
    assert st["total"]["prefill_ms"] == pytest.approx(40.0)
    assert st["per_request"]["decode_ms"] == pytest.approx(50.0)
    assert st["total_seconds"]["transfer_bytes"] == 1024.0
    assert s["errors"] == ["Internal: x"]


def test_stats_empty():
    assert stats_ms([None])["p50"] is None


def test_record_json_roundtrip():
    r = rec(3, 0.5, [0.7, 0.9], session_id="s", turn=2)
    d = r.to_json()
    assert d["ttft_s"] == pytest.approx(0.2)
    assert RequestRecord.from_json(d) == r


def test_slo_parse_and_errors():
    slo = SLO.parse(["ttft:500", "tpot=50", "e2e:4000"])
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms) == (500, 50, 4000)
    for bad in (["ttft"], ["foo:1"], ["ttft:x"], ["tpot:-1"]):
        with pytest.raises(ValueError):
            SLO.parse(bad)


def test_meets_and_vllm_goodput():
    slo = SLO(ttft_ms=300, tpot_ms=100)
    fast = rec(0, 0.0, [0.1, 0.15, 0.2])  # ttft 100, tpot 50
    slow_ttft = rec(1, 0.0, [0.4, 0.45])  # ttft 400
    slow_tpot = rec(2, 0.0, [0.1, 0.3])  # tpot 200
    one_tok = rec(3, 0.0, [0.2])  # tpot undefined -> meets
    failed = rec(4, 0.0, [], error="x")
    records = [fast, slow_ttft, slow_tpot, one_tok, failed]
    assert [meets(r, slo) for r in records] == [True, False, False, True, False]
    assert attainment(records, slo) == pytest.approx(2 / 5)
    assert vllm_goodput(records, slo, duration_s=4.0) == pytest.approx(0.5)
    assert vllm_goodput(records, SLO(e2e_ms=250), duration_s=1.0) == pytest.approx(2.0)


def test_distserve_crossing_between_two_rates():
    pts = [SweepPoint(1, 1.0), SweepPoint(2, 0.96), SweepPoint(4, 0.80), SweepPoint(8, 0.3)]
    g = distserve_goodput(pts, 0.9)
    assert g["max_rate"] == 2
    # linear crossing: 2 + (0.96 - 0.9) / (0.96 - 0.80) * (4 - 2) = 2.75
    assert g["interpolated"] == pytest.approx(2.75)
    assert distserve_goodput([SweepPoint(1, 0.5)])["max_rate"] is None
    # a later recovery above target does not count: the first failure ends the search
    assert distserve_goodput([*pts, SweepPoint(16, 0.95)])["max_rate"] == 2


def test_search_brackets_and_bisects():
    def measure(rate: float) -> float:  # attainment falls linearly, crosses 0.9 at rate 3
        return max(0.0, 1.0 - (rate - 2.0) * 0.1) if rate > 2 else 1.0

    pts = search_goodput_rate(measure, start_rate=1.0, bisect_steps=6)
    rates = [p.rate for p in pts]
    assert rates[:3] == [1.0, 2.0, 4.0]  # doubled until the first failure
    g = distserve_goodput(pts)
    assert 2.9 <= g["max_rate"] <= 3.0

    pts_down = search_goodput_rate(measure, start_rate=16.0, bisect_steps=4)
    assert [p.rate for p in pts_down][:3] == [16.0, 8.0, 4.0]
    assert 2.0 <= distserve_goodput(pts_down)["max_rate"] <= 3.0


def test_itl_stats_are_those_of_every_records_itls_in_order():
    rng = random.Random(3)
    recs = []
    for i in range(300):
        r = RequestRecord(i, 0.0, 0.0, 10, 10)
        t = rng.random()
        for _ in range(rng.choice([0, 1, 2, rng.randint(0, 200)])):
            t += rng.random() * 0.05
            r.token_times.append(t)
        r.n_out = len(r.token_times)
        if rng.random() < 0.9:
            r.finish_s = t + 0.001
        else:
            r.error = "x"  # a failed request's times count for nothing
        recs.append(r)
    done = [r for r in recs if r.ok]
    assert itl_stats_ms(done) == stats_ms(x for r in done for x in r.itls_s)
    assert itl_stats_ms(recs) == itl_stats_ms(done)
    assert itl_stats_ms([]) == stats_ms([])
    assert summarize(recs, 10.0)["itl_ms"]["count"] == sum(len(r.itls_s) for r in done)
