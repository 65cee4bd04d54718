"""DistServe's fitted step-latency form, loaded from its published coefficients, charged by
the simulator exactly as DistServe's own simulator charges whole prefills and decodes."""

from __future__ import annotations

import argparse

import pytest

from pdserve.cli.sim import costs_from_args
from pdserve.costmodel.costs import plan_features
from pdserve.costmodel.distserve import (
    DistServeStep,
    distserve_costs,
    load_distserve,
    parse_cost_model,
)
from pdserve.sim.cluster import SimCluster
from pdserve.sim.run import spec_from_up_flags
from pdserve.workload.requests import BenchRequest

STEP = DistServeStep((18.0, 0.1, 1e-5), (20.0, 0.001, 0.04), (7.0, 0.0005, 0.16), 95, 2.0, 1e-4)


def test_the_published_coefficients_load_with_their_source():
    d = load_distserve("opt-13b")
    assert d["source"]["commit"].startswith("82831f16") and d["gpu"] == "a100"
    tp1 = d["engines"]["distserve"]["1"]
    assert tp1["prefill"] == pytest.approx([18.10, 0.10191, 7.12e-6], rel=1e-3)
    assert d["engines"]["vllm"]["1"]["prefill"] == pytest.approx([22.05, 0.1405, 8.08e-6], rel=1e-3)
    assert set(d["engines"]["distserve"]) == {"1", "2", "4"}
    c = distserve_costs("opt-13b", "distserve", tp=2)
    assert c.devices == 2 and c.kv_capacity_bytes == 163008 * 819200
    assert c.transfer.time_s(1e9) == 0.0  # DistServe's simulator moves KV for free
    assert distserve_costs("opt-13b", network="nvlink3").transfer.time_s(3e8) > 1e-3


def test_prefill_and_decode_forms():
    # prefill of prompts 100 and 300: a + b (400) + c (100^2 + 300^2), + 2 ms + 1e-4 ms / token
    ms = 18.0 + 0.1 * 400 + 1e-5 * (100**2 + 300**2) + 2.0 + 1e-4 * 400
    assert STEP.step_s([(0, 100), (0, 300)]) == pytest.approx(ms / 1e3)
    # decode of 3 sequences with 500, 600, 700 tokens of context: b x sum(context + 1)
    ms = 20.0 + 0.001 * (501 + 601 + 701) + 0.04 * 3 + 2.0 + 1e-4 * 1803
    assert STEP.step_s([(500, 1), (600, 1), (700, 1)]) == pytest.approx(ms / 1e3)
    big = [(500, 1)] * 95  # the large-batch coefficients from 95 sequences
    ms = 7.0 + 0.0005 * 95 * 501 + 0.16 * 95 + 2.0 + 1e-4 * 95 * 501
    assert STEP.step_s(big) == pytest.approx(ms / 1e3)


def test_chunks_and_mixed_steps_and_the_features_path():
    # a chunk of 200 after 300 cached: n^2 + 2 n s, the pairs a whole prompt's l^2 counts
    ms = 18.0 + 0.1 * 200 + 1e-5 * (200**2 + 2 * 200 * 300) + 2.0 + 1e-4 * 500
    assert STEP.step_s([(300, 200)]) == pytest.approx(ms / 1e3)
    # a mixed step: the prefill form over every token + the decodes' context term
    ms = 18.0 + 0.1 * 102 + 1e-5 * 100**2 + 0.001 * (401 + 801) + 2.0 + 1e-4 * 1302
    assert STEP.step_s([(0, 100), (400, 1), (800, 1)]) == pytest.approx(ms / 1e3)
    for batch in ([(0, 100), (0, 300)], [(500, 1), (600, 1)], [(500, 1)] * 120):
        assert STEP.features_s(plan_features(batch)) == pytest.approx(STEP.step_s(batch))


def test_the_simulator_charges_the_entries_of_a_mixed_step():
    costs = distserve_costs("opt-13b")
    spec = spec_from_up_flags(
        ["--mode", "colocated", "--colocated", "1", "--no-kvstore",
         "--worker-arg=--max-num-batched-tokens=256"], costs, 2048)  # fmt: skip
    reqs = [BenchRequest(0, list(range(10, 410)), 3), BenchRequest(1, list(range(20, 120)), 3)]
    records = SimCluster(spec).run(reqs)
    assert all(r.ok and r.n_out == 3 for r in records)
    # 400 + 100 tokens through a 256-token budget: 2 steps of chunks, then mixed/decode steps;
    # the first token of request 0 comes after two chunk steps
    first = costs.step.step_s([(0, 256)]) + costs.step.step_s([(256, 144), (0, 100)])
    assert records[0].token_times[0] == pytest.approx(first, rel=1e-6)


def test_cost_model_option():
    def ns(**kw):
        base = dict(profile=None, cost_model="roofline", model_config=None, hardware=None,
                    network=None, dtype="bfloat16", kv_dtype=None, step_fit="typical")  # fmt: skip
        return argparse.Namespace(**(base | kw))

    pc = costs_from_args(ns(cost_model="distserve:opt-13b:vllm", hardware="a100x2,a100"))
    assert pc["prefill"].devices == 2 and pc["decode"].devices == 1
    assert pc["prefill"].name.endswith("a100x2/vllm")
    assert costs_from_args(ns(cost_model="distserve:opt-13b"))["decode"].name.endswith("/distserve")
    with pytest.raises(SystemExit, match="for a100"):
        costs_from_args(ns(cost_model="distserve:opt-13b", hardware="h100"))
    with pytest.raises(SystemExit, match="tensor parallel 3"):
        costs_from_args(ns(cost_model="distserve:opt-13b", hardware="a100x3"))
    with pytest.raises(SystemExit, match="no DistServe coefficients"):
        costs_from_args(ns(cost_model="distserve:opt-999b"))
    assert parse_cost_model("distserve:/x/y.json:vllm") == ("/x/y.json", "vllm")
    with pytest.raises(ValueError):
        parse_cost_model("vidur:opt-13b")
