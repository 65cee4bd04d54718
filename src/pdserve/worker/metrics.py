"""Prometheus view of a worker: one collector over the same counters the Info RPC returns, so
there is a single source of truth (no double bookkeeping).

Names: `pdserve_worker_<counter>` (e.g. pdserve_worker_decode_leases_expired_total,
pdserve_worker_kvstore_fetched_blocks_total) and gauges for the current load.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from pdserve.worker.core import WorkerCore

GAUGES = {  # the rest only grow
    "pool_free_blocks", "pool_total_blocks", "pool_reservations", "pool_reserved_blocks",
    "pool_held_blocks", "pool_window_free_blocks", "pool_window_total_blocks",
}  # fmt: skip


class WorkerCollector(Collector):
    def __init__(self, core: WorkerCore) -> None:
        self._core = core

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        labels = {"role": self._core.role, "instance": self._core.instance_id}
        for name, value in sorted(self._core.counters().items()):
            metric = f"pdserve_worker_{name}"
            family = GaugeMetricFamily if name in GAUGES else CounterMetricFamily
            fam = family(metric, f"worker counter {name}", labels=list(labels))
            fam.add_metric(list(labels.values()), value)
            yield fam
        load = self._core.load_snapshot()
        for field in ("num_waiting", "num_running", "free_blocks", "num_reserved"):
            fam = GaugeMetricFamily(
                f"pdserve_worker_load_{field}", f"current {field}", labels=list(labels)
            )
            fam.add_metric(list(labels.values()), float(getattr(load, field)))
            yield fam
