"""Capacity-curve simulation (LRU from the chain tail), plots, the cluster launcher and the
compare helpers."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap

import pytest

from pdserve.bench import compare, multiturn
from pdserve.bench.cachesim import StoreCache, parse_capacity, parse_tiers, simulate
from pdserve.bench.cluster import ClusterError, UpProcess
from pdserve.bench.plots import plot_attainment, plot_capacity_curve, plot_latency_cdfs
from pdserve.bench.report import format_ratio_table, ratio_table
from pdserve.workload.traces import TraceRecord

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_parse_capacity():
    assert parse_capacity("64MiB") == 64 * 2**20
    assert parse_capacity("1GiB") == 2**30
    assert parse_capacity("500MB") == 500 * 10**6
    assert parse_capacity("4096") == 4096
    assert parse_capacity("unlimited") is None
    with pytest.raises(ValueError):
        parse_capacity("lots")


def test_store_cache_evicts_from_tail_and_keeps_prefixes():
    # the kvstore's own BlockStore decides: LRU leaf first, so a chain shrinks from its tail
    c = StoreCache(capacity_blocks=4)

    def request(chain):  # what a worker does: fetch (touches the hit), then publish the rest
        hit = c.lookup(chain)
        c.insert(chain)
        return hit

    assert request([1, 2, 3]) == 0  # chain A
    assert request([1, 4]) == 1  # chain B shares block 1 (touched again)
    assert len(c) == 4 and c.contains([1, 2, 3]) == 3
    request([5])  # over capacity: the LRU leaf is 3 (tail of A), not 1 or 2
    assert c.contains([1, 2, 3]) == 2 and c.contains([1, 4]) == 2
    request([6])  # next LRU leaf: 2 (became a leaf when 3 left)
    assert c.contains([1, 2]) == 1 and c.contains([1, 4]) == 2
    c.check_integrity()
    assert c.evictions == 2


def test_store_cache_never_orphans_under_pressure():
    import numpy as np

    rng = np.random.default_rng(0)
    c = StoreCache(capacity_blocks=20)
    for _ in range(300):
        root = int(rng.integers(0, 5))
        chain = [root] + [int(x) for x in 1000 + 100 * root + np.arange(rng.integers(0, 8))]
        c.insert(chain)
        assert len(c) <= 20
        c.check_integrity()


def test_simulate_hit_rates_and_best_case():
    # 512-token blocks; request 2 repeats request 1's two full blocks, the partial one is not cached
    recs = [
        TraceRecord(0, 1100, 1, (0, 1, 2)),
        TraceRecord(1, 1100, 1, (0, 1, 3)),
        TraceRecord(2, 512, 1, (9,)),
        TraceRecord(3, 1100, 1, (0, 1, 4)),
    ]
    best = simulate(recs, None, block_bytes=100)
    assert best.hit_tokens == 2 * 1024 and best.hit_rate == pytest.approx(2048 / 3812)
    tiny = simulate(recs, 200, block_bytes=100)  # 2 blocks: block 9 pushes out block 1
    assert tiny.capacity_blocks == 2 and tiny.hit_tokens == 1024 + 512
    assert simulate(recs, 99, block_bytes=100).hit_tokens == 0


def test_simulate_with_a_disk_tier():
    recs = [
        TraceRecord(0, 1100, 1, (0, 1, 2)),
        TraceRecord(1, 1100, 1, (0, 1, 3)),
        TraceRecord(2, 512, 1, (9,)),
        TraceRecord(3, 1100, 1, (0, 1, 4)),
    ]
    # RAM of 2 blocks + disk of 4: nothing is lost, the last hit comes from disk in part
    two = simulate(recs, 200, block_bytes=100, disk_bytes=400)
    assert two.hit_tokens == simulate(recs, None, block_bytes=100).hit_tokens
    assert 0 < two.disk_hit_tokens < two.hit_tokens
    # a disk smaller than RAM never hurts: a block with a RAM copy only loses its file
    assert simulate(recs, 200, 100, 100).hit_tokens >= simulate(recs, 200, 100).hit_tokens
    assert parse_tiers("1GiB+16GiB") == (2**30, 16 * 2**30)
    assert parse_tiers("unlimited") == (None, 0)
    with pytest.raises(ValueError):
        parse_tiers("1GiB+unlimited")


def test_capacity_curve_cli(tmp_path):
    trace = tmp_path / "m.jsonl"
    lines = [
        {"timestamp": i, "input_length": 1024, "output_length": 3, "hash_ids": [0, 1 + i % 3]}
        for i in range(30)
    ]
    trace.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    out = tmp_path / "cap.json"
    p = argparse.ArgumentParser()
    multiturn.add_parser(p.add_subparsers())
    args = p.parse_args(
        [
            "multiturn",
            "--trace",
            str(trace),
            "--capacity-curve",
            "1KiB,2KiB,unlimited",
            "--kv-bytes-per-token",
            "2",
            "--out",
            str(out),
        ]
    )
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    rates = [r["hit_rate"] for r in data["rows"]]
    assert rates[0] <= rates[1] <= rates[2] == data["best_hit_rate"]
    assert rates[2] > rates[0]
    assert (tmp_path / "cap.png").read_bytes()[:8] == PNG_MAGIC


def test_plots_are_png(tmp_path):
    paths = plot_latency_cdfs(
        {
            "colocated": {"ttft": [1, 2, 3], "tpot": [0.5, 0.7]},
            "disagg": {"ttft": [2, 2.5], "tpot": []},
        },
        tmp_path,
    )
    assert {p.name for p in paths} == {"cdf_ttft.png", "cdf_tpot.png"}
    paths.append(
        plot_attainment({"a": [(1, 1.0), (2, 0.8)], "b": [(1, 0.95)]}, tmp_path / "att.png")
    )
    paths.append(plot_capacity_curve(["1GiB", "unlimited"], [0.1, 0.3], 0.3, tmp_path / "c.png"))
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC


def test_compare_arms_and_ratio_table():
    arms = compare.parse_arms("colocated,disagg")
    assert arms["disagg"] == ["--mode", "disagg", "--prefill", "1", "--decode", "1", "--pin-cpus"]
    custom = compare.parse_arms("a=--mode colocated --colocated 1; b=--mode disagg --decode 2")
    assert custom["b"] == ["--mode", "disagg", "--decode", "2"]
    with pytest.raises(ValueError):
        compare.parse_arms("nonsense")
    assert compare.pick_ratio(["colocated", "disagg"], None) == ("disagg", "colocated")
    results = {
        "disagg": {
            "summary": {"ttft_ms": {"p50": 50.0}, "request_throughput": 3.0},
            "goodput": {"vllm_req_s": 2.0},
        },
        "colocated": {
            "summary": {"ttft_ms": {"p50": 100.0}, "request_throughput": 2.0},
            "goodput": {"vllm_req_s": 1.0},
        },
    }
    rows = {r["metric"]: r for r in ratio_table(results, "disagg", "colocated")}
    assert rows["TTFT p50 (ms)"]["ratio"] == pytest.approx(0.5)
    assert rows["goodput vLLM (req/s)"]["ratio"] == pytest.approx(2.0)
    assert rows["TPOT p99 (ms)"]["ratio"] is None
    assert "TTFT p50" in format_ratio_table(list(rows.values()), "disagg", "colocated")


FAKE_UP = textwrap.dedent("""
    import json, signal, sys, time
    port = int(sys.argv[sys.argv.index("--port") + 1])
    if "--crash" in sys.argv:
        print("boom", flush=True); sys.exit(3)
    signal.signal(signal.SIGTERM, lambda *a: (print("bye", flush=True), sys.exit(0)))
    print("starting", flush=True)
    # a service's ready line relayed before the cluster's: not the cluster's port
    print("PDSERVE_READY " + json.dumps({"service": "worker-colocated", "port": 1}), flush=True)
    time.sleep(0.2)
    print("PDSERVE_READY " + json.dumps({"service": "cluster", "port": port}), flush=True)
    while True:
        time.sleep(0.05)
""")


def test_cluster_waits_for_ready_and_stops(tmp_path):
    script = tmp_path / "fake_up.py"
    script.write_text(FAKE_UP)
    log = tmp_path / "up.log"
    cluster = UpProcess(
        ["--mode", "x"],
        port=50123,
        launcher=[sys.executable, str(script)],
        log_path=log,
        ready_timeout_s=30,
    )
    with cluster as addr:
        assert addr == "127.0.0.1:50123"
        assert cluster.proc.poll() is None
    assert cluster.proc.returncode == 0
    assert "bye" in log.read_text() and "--mode x" in log.read_text()

    bad = UpProcess(["--crash"], launcher=[sys.executable, str(script)], ready_timeout_s=30)
    with pytest.raises(ClusterError, match="boom"):
        bad.start()


def test_kv_bytes_per_token_follows_the_served_dtype(tmp_path):
    """The checkpoint says float32; workers serving bfloat16 (--dtype auto on an AMX CPU)
    hold half the bytes per token."""
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "hidden_size": 64,
                "num_hidden_layers": 3,
                "torch_dtype": "float32",
            }
        )
    )
    p = argparse.ArgumentParser()
    multiturn.add_parser(p.add_subparsers())
    base = ["multiturn", "--model", str(tmp_path)]
    checkpoint = multiturn.kv_bytes_per_token(p.parse_args(base))
    served = multiturn.kv_bytes_per_token(p.parse_args([*base, "--kv-dtype", "bfloat16"]))
    assert checkpoint == 2 * 3 * 2 * 16 * 4  # K and V x layers x kv heads x head_dim x fp32
    assert served == checkpoint // 2
