"""The offline length model: deterministic training, rank statistics with known
values, and `pdserve predictor evaluate` on a fixture made here."""

import gzip
import itertools
import json
import random

import numpy as np
import pytest

from pdserve.cli.main import main
from pdserve.router.scheduling.predictor import LengthQuery
from pdserve.router.scheduling.predictor.offline import (
    DEFAULT_DIR,
    TextLengthModel,
    TrainConfig,
    train,
)
from pdserve.router.scheduling.predictor.stats import kendall_tau, spearman, summarize

SMALL = TrainConfig(dim=1 << 12, folds=3, knn_keep=64)
TOPICS = ["rust", "python", "sql", "tea", "bikes", "rome", "jazz", "mars", "bees", "chess"]
MODELS = {"short-model": 0.5, "long-model": 2.0}


def fixture_rows(seed: int = 0) -> list[dict]:
    """Two templates: essays (long answers) and yes/no questions (short), two models
    with different verbosity, train and val topics disjoint."""
    rng = random.Random(seed)
    rows = []
    for i, (topic, kind) in enumerate(itertools.product(TOPICS, ["essay", "yesno"])):
        split = "val" if topic in ("jazz", "mars", "bees", "chess") else "train"
        prompt = (
            f"Write a long detailed essay about {topic} with many sections and examples."
            if kind == "essay"
            else f"Answer only yes or no: is {topic} nice?"
        )
        base = 600 if kind == "essay" else 12
        for model, scale in MODELS.items():
            rows.append(
                {
                    "source": "fx",
                    "prompt_id": f"p{i}",
                    "prompt": prompt,
                    "model_canonical": model,
                    "prompt_split": split,
                    "prompt_tokens_cl100k": len(prompt) // 4,
                    "response_tokens_cl100k": int(base * scale * rng.uniform(0.8, 1.25)),
                }
            )
    return rows


def brute_tau(x, y):
    s = na = nb = 0
    for i in range(len(x)):
        for j in range(len(x)):
            a, b = np.sign(x[i] - x[j]), np.sign(y[i] - y[j])
            s += a * b
            na += a != 0
            nb += b != 0
    return s / np.sqrt(na * nb)


def test_rank_statistics_known_values():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(4 / 6)
    assert spearman([1, 2, 3, 4], [10, 20, 40, 30]) == pytest.approx(0.8)
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 5, 50), rng.integers(0, 4, 50)  # many ties
    assert kendall_tau(x, y, chunk=7) == pytest.approx(brute_tau(x, y))
    s = summarize([10, 100, 300], [20, 250, 300], [12, 300, 301], ["a", "a", "a"], min_group=3)
    assert s["n"] == 3 and s["kendall_tau"] == pytest.approx(1.0)
    assert s["kendall_tau_per_model"] == pytest.approx(1.0)
    assert s["p90_coverage"] == pytest.approx(1 / 3, abs=1e-4)  # 12 <= 20; 300 > 250; 301 > 300
    assert s["bucket_accuracy"] == pytest.approx(
        2 / 3, abs=1e-4
    )  # 10~12 and 300~301 share a bucket
    assert s["mae_log"] == pytest.approx(
        np.mean(np.abs(np.log1p([10, 100, 300]) - np.log1p([12, 300, 301]))), abs=1e-4
    )


def test_training_is_deterministic_and_learns_the_templates(tmp_path):
    from pdserve.router.scheduling.predictor.offline import save_model

    rows = [r for r in fixture_rows() if r["prompt_split"] == "train"]
    a = save_model(train(rows, SMALL), tmp_path / "a")
    b = save_model(train(list(reversed(rows)), SMALL), tmp_path / "b")
    for name in ("model.json", "weights.npz"):
        assert (a / name).read_bytes() == (b / name).read_bytes()
    model = TextLengthModel.load(a)
    essay = "Write a long detailed essay about owls with many sections and examples."
    short = "Answer only yes or no: is owls nice?"
    q = dict(num_prompt_tokens=20, max_tokens=4096)
    e_long = model.estimate(LengthQuery(model="long-model", text=essay, **q))
    e_short = model.estimate(LengthQuery(model="long-model", text=short, **q))
    assert e_long.p50 > 5 * e_short.p50
    assert e_long.p90 >= e_long.p50
    # the model is a feature: the verbose model is predicted longer on the same prompt
    e_terse = model.estimate(LengthQuery(model="short-model", text=essay, **q))
    assert e_long.p50 > 2 * e_terse.p50
    # unknown model: pooled calibration; max_tokens clamps
    assert model.estimate(LengthQuery(model="nope", text=essay, **q)).p50 > 0
    assert model.estimate(LengthQuery(20, 7, "long-model", essay)).p90 <= 7


def test_cli_train_and_evaluate_on_a_fixture(tmp_path, capsys):
    data = tmp_path / "lengths.jsonl.gz"
    with gzip.open(data, "wt") as f:
        for r in fixture_rows():
            f.write(json.dumps(r) + "\n")
    out = tmp_path / "art"
    assert (
        main(["predictor", "train", "--data", str(data), "--out", str(out), "--dim", "4096"]) == 0
    )
    capsys.readouterr()
    argv = ["predictor", "evaluate", "--data", str(data), "--predictor", str(out)]
    assert main([*argv, "--split", "val", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["n"] == 16 and res["mode"] == "offline"
    model = TextLengthModel.load(out)
    rows = [r for r in fixture_rows() if r["prompt_split"] == "val"]
    p50 = [
        np.expm1(model.log_quantiles(model.score(r["prompt"], r["prompt_tokens_cl100k"]), m)[0])
        for r in rows
        for m in [r["model_canonical"]]
    ]
    assert res["kendall_tau"] == pytest.approx(
        kendall_tau(p50, [r["response_tokens_cl100k"] for r in rows]), abs=1e-4
    )
    assert res["kendall_tau"] > 0.5
    for key in ("kendall_tau_per_model", "spearman", "mae_log", "p90_coverage", "bucket_accuracy"):
        assert key in res


def test_the_shipped_artifact_loads_and_ranks():
    model = TextLengthModel.load(DEFAULT_DIR)
    assert len(model.cal) > 50
    q = dict(num_prompt_tokens=30, max_tokens=8192, model="gpt-4-0613")
    long = model.estimate(
        LengthQuery(text="Write a detailed 2000-word essay on the history of Rome.", **q)
    )
    short = model.estimate(LengthQuery(text="What is 2+2? Answer with one number only.", **q))
    assert long.p50 > short.p50
