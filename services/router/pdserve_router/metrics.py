"""Prometheus metrics of the router and the totals that Status reports."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


@dataclass
class Totals:
    """Counters since start (reported by Status)."""

    requests: int = 0
    running: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0


class RouterMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        reg = REGISTRY if registry is None else registry
        self.requests = Counter("pdserve_router_requests", "finished requests",
                                ["finish_reason"], registry=reg)
        self.errors = Counter("pdserve_router_request_errors", "requests failed with a status",
                              ["code"], registry=reg)
        self.ttft = Histogram("pdserve_router_ttft_seconds", "arrival to first token sent",
                              buckets=_LATENCY_BUCKETS, registry=reg)
        self.tpot = Histogram("pdserve_router_tpot_seconds", "mean time per output token after "
                              "the first", buckets=_TPOT_BUCKETS, registry=reg)
        self.e2e = Histogram("pdserve_router_e2e_seconds", "arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=reg)
        self.prompt_tokens = Counter("pdserve_router_prompt_tokens", "prompt tokens", registry=reg)
        self.cached_tokens = Counter("pdserve_router_cached_tokens",
                                     "prompt tokens served from a KV cache", registry=reg)
        self.completion_tokens = Counter("pdserve_router_completion_tokens", "generated tokens",
                                         registry=reg)
        self.prefill_retries = Counter("pdserve_router_prefill_retries",
                                       "prefill attempts beyond the first", registry=reg)
        self.inflight = Gauge("pdserve_router_instance_inflight",
                              "requests the router has in flight per instance",
                              ["instance", "role"], registry=reg)
        self.instances = Gauge("pdserve_router_instances", "registered instances", ["role"],
                               registry=reg)
