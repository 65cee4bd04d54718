"""Metrics helpers and the /metrics HTTP endpoint."""

from __future__ import annotations

import socket
import urllib.request

import pytest
from prometheus_client import CollectorRegistry

from pdserve.rpc.metrics import Metrics, start_metrics_server


def test_prefix_and_idempotent_declaration() -> None:
    m = Metrics(CollectorRegistry())
    c = m.counter("blocks_sent", "blocks sent", ("peer",))
    assert m.counter("pdserve_blocks_sent", "blocks sent", ("peer",)) is c
    c.labels("a").inc(3)
    assert m.value("blocks_sent_total", {"peer": "a"}) == 3
    # A second Metrics object on the same registry gets the same collector.
    assert Metrics(m.registry).counter("blocks_sent", "blocks sent", ("peer",)) is c
    with pytest.raises(TypeError):
        m.gauge("blocks_sent", "now a gauge")


def test_histogram_and_gauge() -> None:
    m = Metrics(CollectorRegistry())
    h = m.histogram("step_seconds", "engine step", buckets=(0.1, 1.0))
    h.observe(0.5)
    g = m.gauge("queue_depth", "waiting requests")
    g.set(4)
    assert m.value("step_seconds_bucket", {"le": "0.1"}) == 0
    assert m.value("step_seconds_bucket", {"le": "1.0"}) == 1
    assert m.value("queue_depth") == 4


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_server_serves_registry() -> None:
    assert start_metrics_server(0) is None  # 0 = off
    m = Metrics(CollectorRegistry())
    m.counter("hits", "cache hits").inc()
    server = start_metrics_server(_free_port(), m.registry)
    assert server is not None
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics", timeout=10) as r:
            text = r.read().decode()
    finally:
        server.close()
    assert "pdserve_hits_total 1.0" in text
