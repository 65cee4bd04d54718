"""Arrival processes, length distributions and the Mooncake hash-id -> token prefix mapping."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.workload.arrivals import (
    arrivals_for_duration,
    gamma_arrivals,
    mean_rate,
    poisson_arrivals,
    replay_arrivals,
)
from pdserve.workload.requests import (
    TOKEN_LO,
    LengthDist,
    clip_lengths,
    hash_id_tokens,
    mooncake_block_tokens,
    mooncake_prompt,
    synthetic_requests,
    trace_requests,
)
from pdserve.workload.traces import TraceRecord


def test_poisson_seeded_and_mean_rate():
    a = poisson_arrivals(4000, rate=5.0, seed=7)
    assert a == poisson_arrivals(4000, rate=5.0, seed=7)
    assert a != poisson_arrivals(4000, rate=5.0, seed=8)
    assert a[0] == 0.0 and bool(np.all(np.diff(a) >= 0))
    assert mean_rate(a) == pytest.approx(5.0, rel=0.06)
    gaps = np.diff(a)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, rel=0.1)  # exponential: CV 1


def test_gamma_burstiness_keeps_rate_changes_variance():
    bursty = gamma_arrivals(4000, rate=2.0, burstiness=0.25, seed=1)
    regular = gamma_arrivals(4000, rate=2.0, burstiness=4.0, seed=1)
    assert mean_rate(bursty) == pytest.approx(2.0, rel=0.1)
    assert mean_rate(regular) == pytest.approx(2.0, rel=0.05)
    cv = lambda t: np.std(np.diff(t)) / np.mean(np.diff(t))  # noqa: E731
    assert cv(bursty) == pytest.approx(2.0, rel=0.15)  # CV = 1 / sqrt(shape)
    assert cv(regular) == pytest.approx(0.5, rel=0.1)
    with pytest.raises(ValueError):
        gamma_arrivals(3, rate=0)


def test_duration_bounded_is_prefix_of_one_sequence():
    short = arrivals_for_duration(10.0, rate=3.0, seed=2)
    long = arrivals_for_duration(100.0, rate=3.0, seed=2)
    assert all(t < 10.0 for t in short) and long[: len(short)] == short
    assert len(long) == pytest.approx(300, rel=0.15)


def test_replay_time_scale_and_rate():
    ts = [10.0, 11.0, 13.0, 20.0]
    assert replay_arrivals(ts) == [0.0, 1.0, 3.0, 10.0]
    assert replay_arrivals(ts, time_scale=0.5) == [0.0, 0.5, 1.5, 5.0]
    r = replay_arrivals(ts, rate=3.0)
    assert mean_rate(r) == pytest.approx(3.0)


def test_length_distributions():
    rng = np.random.default_rng(0)
    assert LengthDist.parse("fixed:7").sample(3, rng) == [7, 7, 7]
    u = LengthDist.parse("uniform:5,9").sample(2000, rng)
    assert min(u) == 5 and max(u) == 9
    ln = LengthDist.parse("lognormal:200,0.5").sample(20000, rng)
    assert np.mean(ln) == pytest.approx(200, rel=0.03)
    for bad in ("fixed", "uniform:9,5", "gauss:1,2", "fixed:x"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


def test_clip_to_context():
    assert clip_lengths(5000, 300, 2048) == (1748, 300)
    assert clip_lengths(100, 5000, 2048) == (100, 1024)
    assert clip_lengths(0, 0, None) == (1, 1)


def test_synthetic_requests_seeded_prefix_stable_and_in_vocab():
    a = synthetic_requests(
        20,
        LengthDist.parse("uniform:4,40"),
        LengthDist.parse("fixed:8"),
        vocab_size=100,
        seed=3,
        max_model_len=32,
    )
    b = synthetic_requests(
        30,
        LengthDist.parse("uniform:4,40"),
        LengthDist.parse("fixed:8"),
        vocab_size=100,
        seed=3,
        max_model_len=32,
    )
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b[:20]]
    assert all(len(r.prompt_ids) + r.max_tokens <= 32 for r in a)
    assert all(TOKEN_LO <= t < 100 for r in a for t in r.prompt_ids)


def test_hash_id_tokens_fixed_per_id():
    assert hash_id_tokens(5, 64, 500) == hash_id_tokens(5, 64, 500)
    assert hash_id_tokens(5, 64, 500) != hash_id_tokens(6, 64, 500)


def test_mooncake_shared_ids_share_exact_prefix():
    bt = mooncake_block_tokens(0.125, kv_block_size=16)
    assert bt == 64
    records = [
        TraceRecord(0.0, 1100, 50, (0, 1, 2)),
        TraceRecord(0.5, 1500, 20, (0, 1, 7)),
        TraceRecord(0.9, 900, 5, (0, 8)),
        TraceRecord(1.0, 1024, 5, (3, 1)),
    ]
    reqs = trace_requests(records, vocab_size=1000, seed=1, length_scale=0.125, kv_block_size=16)
    p0, p1, p2, p3 = (r.prompt_ids for r in reqs)
    assert [len(p) for p in (p0, p1, p2)] == [138, 188, 112]
    assert [r.max_tokens for r in reqs] == [6, 2, 1, 1]
    assert p0[:128] == p1[:128]  # ids (0, 1) shared: two scaled blocks
    assert p0[128:138] != p1[128:138]  # then ids 2 vs 7 differ
    assert p0[:64] == p2[:64] and p0[64:128] != p2[64:128]
    assert p3[:64] != p0[:64]  # a different first id: no shared prefix
    # the mapping does not depend on which request uses the id, nor on the request order
    assert mooncake_prompt((0, 1), 128, 64, 1000, seed=1) == p0[:128]


def test_mooncake_prompt_pads_when_ids_are_short():
    p = mooncake_prompt((4,), 100, 64, 1000, seed=0)
    assert len(p) == 100 and p[:64] == hash_id_tokens(4, 64, 1000, seed=0)
