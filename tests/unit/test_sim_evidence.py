"""The evidence script's statistics and its predictor of chosen quality."""

from __future__ import annotations

import math

import pytest

from pdserve.router.scheduling.predictor import LengthQuery
from pdserve.router.scheduling.predictor.stats import kendall_tau
from pdserve.sim.evidence import NoisyOracle, ci


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
