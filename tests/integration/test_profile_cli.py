"""`pdserve profile` end to end, under the default mutual TLS: the engine, UCX and a real
kvstore process (which refuses to start without TLS material unless --insecure)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def test_profile_runs_under_default_tls(serving_model_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_INSECURE"}  # the default: TLS
    out = tmp_path / "profile.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli.main", "profile", "--model", str(serving_model_dir),
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    costs = data["costs"]
    # every part was measured: the kvstore over TLS included
    assert data["kvstore"] is not None and data["kvstore"]["rpc_rtt_s"] > 0
    assert len(data["kvstore"]["samples"]["put"]) == 3
    assert costs["kvstore_fetch"]["latency_s"] >= 0 and costs["router_overhead_s"] > 0
    assert data["engine"]["samples"], "no engine step timed"
    assert "kvstore_publish" in proc.stdout
    # the serving stack's cost per streamed token, from a real router + worker (under TLS)
    serving = data["serving"]
    assert [p["streams"] for p in serving["samples"]] == [1, 2, 4, 8, 16]
    assert [x for x, _ in costs["stream_points"]] == [1, 2, 4, 8, 16]
    assert all(p["tpot_s"] > 0 for p in serving["samples"])
    # the worker's own step counters (its Info RPC) over each phase: the machine's speed then
    assert all(p["served_step_s"] > 0 for p in serving["samples"])
    assert costs["stream_token_s"] == serving["stream_token_s"] >= 0
    assert "per streamed sequence per step" in proc.stdout
    # per prompt: served prefill stages of 4 lengths, fitted over their own steps; the
    # request path measured on the served prompts is what the simulator charges per request
    lens = sorted({p["tokens"] for p in serving["prefill_samples"]})
    assert len(lens) == 4 and lens[:3] == [8, 32, 128] and lens[3] <= 256  # within the context
    assert all(
        p["prefill_s"] > 0 and p["ttft_s"] >= p["prefill_s"] for p in serving["prefill_samples"]
    )
    assert all(p["served_step_s"] > 0 for p in serving["prefill_samples"])  # its own steps
    assert all(p["served_step_s"] > 0 for p in data["served_1p1d"]["idle_prompts"])
    assert costs["prefill_chunk_s"] == serving["prefill_chunk_s"] >= 0
    assert costs["prefill_token_s"] == serving["prefill_token_s"] >= 0
    assert costs["router_overhead_s"] == serving["path_overhead_s"] > 0
    # the served 1P1D: each role's neighbour factor, the disaggregated request's own path and
    # the prefill role's prompt extra
    roles = data["roles"]
    assert roles["prefill"]["neighbour_busy_factor"] >= 1.0
    assert roles["decode"]["neighbour_busy_factor"] >= 1.0
    assert roles["prefill"]["router_overhead_s"] == roles["decode"]["router_overhead_s"] > 0
    # measured on its own (the stage beyond a same-length prompt that pushes nothing), not
    # as the colocated extra plus a difference, so it need not exceed the colocated one
    from pdserve.sim.profile_pd import disaggregated_prompt_extra

    own = disaggregated_prompt_extra(data["served_1p1d"]["idle_prompts"], 512, None, (0.0, 0.0))
    assert (roles["prefill"]["prefill_chunk_s"], roles["prefill"]["prefill_token_s"]) == own
    assert data["served_1p1d"]["idle_prompts"], "no idle 1P1D prompt timed"
    # the prefill's factor beside a decode of 1 and of 4 streams; the decode's own serving
    # work per step at 1-16 streams; the Reserve's round trip, part of the path
    assert [x for x, _ in roles["prefill"]["neighbour_points"]] == [1, 4]
    assert all(y >= 1.0 for _, y in roles["prefill"]["neighbour_points"])
    assert [x for x, _ in roles["decode"]["stream_points"]] == [1, 2, 4, 8, 16]
    assert 0 < roles["decode"]["reserve_s"] <= roles["decode"]["router_overhead_s"]
    assert "1P1D decode" in proc.stdout
    # the served probe on each of the profile's clusters: the baseline of a later --probe
    for part in (serving, data["served_1p1d"]):
        assert part["served_probe"]["ttft_s"] > 0 and part["served_probe"]["tpot_s"] > 0
    assert "served probe" in proc.stdout
    # a cold prompt step: one pair per length per round (64, 160, 300 tokens, within the
    # model's context), their median, never negative, in the costs and the prefill role
    pd = data["served_1p1d"]
    assert len(pd["cold_samples"]) == 3 * len(pd["per_round"])
    assert pd["cold_prompt_s"] == max(0.0, statistics.median(pd["cold_samples"]))
    assert costs["cold_prompt_s"] == roles["prefill"]["cold_prompt_s"] == pd["cold_prompt_s"]
    # the machine's speed right after the engine's steps: the baseline of a later --probe
    assert data["probe"]["steps"] > 0 and data["probe"]["prefill_factor"] > 0
    # the token term follows the prompt sizes sampled, never falling
    step = costs["step"]
    assert step["token_knots"][0] == 0 and all(s >= 0 for s in step["token_slopes"])
