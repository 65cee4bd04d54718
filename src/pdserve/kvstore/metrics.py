"""Prometheus metrics of the kvstore (`pdserve.kvstore_*`)."""

from __future__ import annotations

from pdserve.kvstore.stats import StoreStats
from pdserve.rpc.metrics import Metrics


class KVStoreMetrics:
    def __init__(self, metrics: Metrics) -> None:
        m = metrics
        self.lookups = m.counter("kvstore_lookups", "Lookup calls")
        self.hit_blocks = m.counter("kvstore_hit_blocks", "blocks found by Lookup")
        self.miss_blocks = m.counter("kvstore_miss_blocks", "blocks not found by Lookup")
        self.fetch_seconds = m.histogram("kvstore_fetch_seconds", "Fetch: gather + UCX send")
        self.fetch_tier_seconds = m.histogram(
            "kvstore_fetch_tier_seconds",
            "Fetch: gather + UCX send, by tier (disk = at least one block read from a file)",
            ["tier"],
        )
        self.fetched_bytes = m.counter("kvstore_fetched_bytes", "bytes sent by Fetch")
        self.stored_bytes = m.gauge("kvstore_stored_bytes", "bytes in use (stored + reserved)")
        self.stored_blocks = m.gauge("kvstore_stored_blocks", "blocks stored")
        self.evictions = m.counter("kvstore_evictions", "blocks evicted")
        self.disk_bytes = m.gauge("kvstore_disk_bytes", "block bytes on disk (or being written)")
        self.disk_blocks = m.gauge("kvstore_disk_blocks", "blocks with a copy on disk")
        self.puts = m.counter("kvstore_puts", "put outcomes", ["outcome"])
        self.writer_blocks = m.counter(
            "kvstore_writer_blocks", "blocks stored, by writer identity", ["writer"]
        )
        self._evictions_seen = 0

    def sync(self, stats: StoreStats) -> None:
        """Mirror the store's counters after an operation."""
        self.stored_bytes.set(stats.used_bytes)
        self.stored_blocks.set(stats.num_blocks)
        self.disk_bytes.set(stats.disk_used_bytes)
        self.disk_blocks.set(stats.disk_blocks)
        if stats.evictions > self._evictions_seen:
            self.evictions.inc(stats.evictions - self._evictions_seen)
            self._evictions_seen = stats.evictions
