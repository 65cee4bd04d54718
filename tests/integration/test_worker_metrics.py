"""A worker's Prometheus endpoint exposes the same counters as its Info RPC (checked one by
one, once the worker is idle), and counts the KV it received."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from pdserve.client import Client
from pdserve.launcher import Cluster, ClusterConfig
from pdserve.worker.metrics import GAUGES

from .conftest import pool_idle, wait_until, worker_info

pytestmark = pytest.mark.integration


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name.split("{")[0]] = float(value)
    return samples


def test_decode_worker_metrics_count_kv_bytes(serving_model_dir, tmp_path):
    port = _free_port()
    config = ClusterConfig(
        model=str(serving_model_dir),
        port=0,
        prefill=1,
        decode=1,
        log_dir=str(tmp_path),
        worker_args=["--num-blocks", "128"],
    )
    with Cluster(config) as cluster:
        # Only the decode worker gets a metrics port: restart it with one.
        cluster.config.worker_args = ["--num-blocks", "128", "--metrics-port", str(port)]
        cluster.restart("decode0")
        before = _scrape(port)
        result = Client(cluster.addr).generate(
            token_ids=list(range(1, 41)), max_tokens=4, temperature=0.0, ignore_eos=True
        )
        assert len(result.token_ids) == 4
        wait_until(lambda: pool_idle(cluster, "decode0"), 15, "decode idle")
        info = worker_info(cluster, "decode0")
        after = _scrape(port)
    assert len(info.counters) >= 10
    for name, value in info.counters.items():
        metric = f"pdserve_worker_{name}" + ("" if name in GAUGES else "_total")
        assert after[metric] == value, name
    assert after["pdserve_worker_load_num_reserved"] == info.load.num_reserved == 0
    received = "pdserve_worker_ucx_bytes_received_total"
    assert after[received] - before.get(received, 0.0) > 0
    assert after["pdserve_worker_decode_admitted_total"] >= 1
    assert after["pdserve_worker_pool_total_blocks"] == 128
