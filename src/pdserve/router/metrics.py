"""Prometheus metrics of the router (on the process's pdserve.rpc Metrics) and
the totals that Status reports."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.rpc.metrics import Metrics

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
    def __init__(self, metrics: Metrics) -> None:
        m = metrics
        self.requests = m.counter("router_requests", "finished requests", ["finish_reason"])
        self.errors = m.counter("router_request_errors", "requests failed with a status", ["code"])
        self.ttft = m.histogram(
            "router_ttft_seconds", "arrival to first token sent", buckets=_LATENCY_BUCKETS
        )
        self.tpot = m.histogram(
            "router_tpot_seconds",
            "mean time per output token after the first",
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = m.histogram(
            "router_e2e_seconds", "arrival to last token", buckets=_LATENCY_BUCKETS
        )
        self.prompt_tokens = m.counter("router_prompt_tokens", "prompt tokens")
        self.cached_tokens = m.counter(
            "router_cached_tokens", "prompt tokens served from a KV cache"
        )
        self.completion_tokens = m.counter("router_completion_tokens", "generated tokens")
        self.prefill_retries = m.counter(
            "router_prefill_retries", "prefill attempts beyond the first"
        )
        self.migrations = m.counter(
            "router_migrations",
            "streams moved to another worker after theirs died mid-stream",
            ["reason"],
        )
        self.resumes = m.counter(
            "router_resumes",
            "Resume calls: streams continued here after their router died, or refused",
            ["outcome"],  # resumed | not_found | permission_denied | failed_precondition | ...
        )
        self.inflight = m.gauge(
            "router_instance_inflight",
            "requests the router has in flight per instance",
            ["instance", "role"],
        )
        self.instances = m.gauge("router_instances", "registered instances", ["role"])
        self._inflight_roles: dict[str, str] = {}  # instance -> role label of its series

    def set_inflight(self, instance_id: str, role: str, value: float) -> None:
        """Set an instance's in-flight gauge; a role change replaces its old series."""
        old = self._inflight_roles.get(instance_id)
        if old is not None and old != role:
            self._remove_inflight(instance_id, old)
        self._inflight_roles[instance_id] = role
        self.inflight.labels(instance_id, role).set(value)

    def forget_instance(self, instance_id: str) -> None:
        """The instance left the registry: drop its per-instance series."""
        role = self._inflight_roles.pop(instance_id, None)
        if role is not None:
            self._remove_inflight(instance_id, role)

    def _remove_inflight(self, instance_id: str, role: str) -> None:
        try:
            self.inflight.remove(instance_id, role)
        except KeyError:  # never set
            pass
