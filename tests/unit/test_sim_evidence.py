"""The evidence script's statistics and its predictor of chosen quality."""

from __future__ import annotations

import math

import pytest

from benchmarks.evidence.run import NoisyOracle
from benchmarks.evidence.stats import ci
from pdserve.router.scheduling.predictor import LengthQuery
from pdserve.router.scheduling.predictor.stats import kendall_tau


def test_ci_is_student_t_over_seeds():
    m, h = ci([1.0, 2.0, 3.0, 4.0, 5.0])
    assert m == 3.0
    assert h == pytest.approx(2.776 * math.sqrt(2.5) / math.sqrt(5))
    assert math.isnan(ci([1.0])[1])


def test_noisy_oracle_quality_falls_with_noise():
    taus = []
    for sigma in (0.0, 0.7, 2.0):
        p = NoisyOracle(sigma, seed=1)
        for n in range(1, 400):
            p.estimate(LengthQuery(10, 1 << 30, oracle_tokens=n))
        taus.append(kendall_tau(*zip(*p.pairs, strict=True)))
    assert taus[0] == pytest.approx(1.0) and taus[0] > taus[1] > taus[2] > 0


def test_trace_seeds_replay_disjoint_windows(monkeypatch):
    from benchmarks.evidence import run as evidence

    seen = []
    monkeypatch.setattr(evidence, "workload_at", lambda a, rate, salt: seen.append(a) or [])
    monkeypatch.setattr(evidence, "text_prompt_ids", lambda reqs, vocab: reqs)
    for seed in (1, 2, 3):
        evidence.requests_for("mooncake", seed, 300, 10.0)
    assert [a.trace_offset for a in seen] == [0, 300, 600]
    evidence.requests_for("mooncake", 3, 300, 10.0, window=False)
    evidence.requests_for("lengths", 3, 300, 10.0)
    assert [a.trace_offset for a in seen[3:]] == [0, 0]  # lengths: the seed draws, no window


def test_emulated_flips_are_counted_from_the_router_log(tmp_path):
    from benchmarks.evidence.emulated import router_flips

    assert router_flips(tmp_path) == 0
    (tmp_path / "router.log").write_text(
        '{"event": "flip started", "instance": "w1"}\n{"event": "flip done", "instance": "w1"}\n'
        '{"event": "flip decision"}\n'
    )
    (tmp_path / "router.1700000000000.log").write_text('{"event": "flip done"}\n')  # restarted
    (tmp_path / "prefill-0.log").write_text('{"event": "flip done"}\n')  # not the router's
    assert router_flips(tmp_path) == 2
    import os

    old = tmp_path / "router.1600000000000.log"  # an earlier run's, in the same directory
    old.write_text('{"event": "flip done"}\n')
    os.utime(old, (1.0, 1.0))
    assert router_flips(tmp_path, since=1000.0) == 2
    assert router_flips(tmp_path) == 3
