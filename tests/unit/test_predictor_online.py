"""The online learner: prefix memory on a templated stream, drift, cold start."""

import math
import random

import pytest

from pdserve.router.scheduling.predictor import EwmaPredictor, LengthQuery, OraclePredictor
from pdserve.router.scheduling.predictor.evaluate import evaluate_online
from pdserve.router.scheduling.predictor.online import OnlineLengthPredictor
from pdserve.router.scheduling.predictor.stats import kendall_tau


def templated_stream(n: int, seed: int = 0) -> list[dict]:
    """8 templates (a shared system block, then a template block), each with its own
    typical output length; the suffix block is unique per request."""
    rng = random.Random(seed)
    typical = [8, 20, 45, 90, 150, 260, 400, 700]
    rows = []
    for i in range(n):
        t = rng.randrange(len(typical))
        rows.append(
            {
                "timestamp": i,
                "input_length": 1000,
                "hash_ids": [0, 100 + t, 10_000 + i],
                "output_length": max(1, int(typical[t] * rng.lognormvariate(0, 0.25))),
            }
        )
    return rows


def test_online_learner_improves_tau_on_a_templated_stream():
    rows = templated_stream(600)
    p = OnlineLengthPredictor()
    first, second = [], []
    for i, r in enumerate(rows):
        q = LengthQuery(r["input_length"], 1 << 20, block_hashes=tuple(r["hash_ids"]))
        est = p.estimate(q)
        (first if i < 50 else second).append((est.p50, r["output_length"]))
        p.learn(q, r["output_length"])
    tau_late = kendall_tau(*zip(*second, strict=True))
    assert tau_late > 0.6
    assert tau_late > kendall_tau(*zip(*first, strict=True)) + 0.2
    assert p.running_tau() > 0.6
    ewma = evaluate_online(EwmaPredictor(), rows)
    assert abs(ewma["kendall_tau"]) < 0.2  # one number for everyone: no ranking


def test_cold_start_and_drift():
    p = OnlineLengthPredictor(initial=64)
    q = LengthQuery(10, 4096, model="m")
    assert p.estimate(q).p50 == pytest.approx(64)  # nothing learned yet
    for _ in range(100):
        p.learn(q, 100)
    assert abs(p.estimate(q).p50 - 100) < 10
    for _ in range(150):  # the model starts answering 4x longer
        p.learn(q, 400)
    assert abs(math.log(p.estimate(q).p50 / 400)) < math.log(1.3)
    assert p.estimate(q).p90 >= p.estimate(q).p50
    assert p.estimate(LengthQuery(10, 50, model="m")).p50 == 50  # clamped to max_tokens


def test_sessions_remember_their_lengths():
    p = OnlineLengthPredictor()
    for s, n in (("a", 20), ("b", 500)):
        for _ in range(5):
            p.learn(LengthQuery(10, 4096, session_id=s), n)
    short = p.estimate(LengthQuery(10, 4096, session_id="a")).p50
    long = p.estimate(LengthQuery(10, 4096, session_id="b")).p50
    assert long > 5 * short


def test_oracle_uses_the_true_length_only_when_given():
    o = OraclePredictor(EwmaPredictor(initial=30))
    assert o.estimate(LengthQuery(5, 100, oracle_tokens=77)).p50 == 77
    assert o.estimate(LengthQuery(5, 100)).p50 == 30
