"""Prometheus metrics: one registry per process, metric names prefixed `pdserve_`.

Convention: a process creates one `Metrics` (default: prometheus_client's process registry)
and hands it to the components that declare metrics; tests pass `Metrics(CollectorRegistry())`
so that several services in one test process do not collide. Declaring the same metric twice
on one registry returns the existing one (idempotent), so components need no coordination;
declaring one name with another kind, help text or label set raises (two meanings of one
series would silently overwrite each other).

    metrics = Metrics()
    hits = metrics.counter("prefix_cache_hits", "blocks found in the prefix cache")
    server = start_metrics_server(settings.metrics_port, metrics.registry)  # None when 0
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

import grpc
import prometheus_client
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pdserve.logging import get_logger
from pdserve.rpc._wrap import StreamBehavior, UnaryBehavior, WrappingInterceptor

PREFIX = "pdserve_"
# Seconds; RPCs range from sub-millisecond control calls to minute-long token streams.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

M = TypeVar("M", Counter, Gauge, Histogram)
_log = get_logger(__name__)


class Metrics:
    """Declares `pdserve_*` metrics on one registry; idempotent per name."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else prometheus_client.REGISTRY
        self._declared: dict[str, Any] = {}

    @staticmethod
    def full_name(name: str) -> str:
        return name if name.startswith(PREFIX) else PREFIX + name

    def _declare(self, kind: type[M], name: str, doc: str, labels: Sequence[str], **kw: Any) -> M:
        full = self.full_name(name)
        found = self._declared.get(full)
        if found is None:
            try:
                found = kind(full, doc, list(labels), registry=self.registry, **kw)
            except ValueError:  # declared on this registry by another Metrics object
                found = _lookup(self.registry, full)
                if found is None:
                    raise
            self._declared[full] = found
        if not isinstance(found, kind):
            raise TypeError(f"metric {full} already declared as {type(found).__name__}")
        was = (getattr(found, "_documentation", doc), tuple(getattr(found, "_labelnames", labels)))
        if was != (doc, tuple(labels)):
            raise ValueError(
                f"metric {full} declared twice with different help or labels: {was} vs "
                f"{(doc, tuple(labels))}"
            )
        return found

    def counter(self, name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
        return self._declare(Counter, name, doc, labels)

    def gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return self._declare(Gauge, name, doc, labels)

    def histogram(
        self,
        name: str,
        doc: str,
        labels: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> Histogram:
        return self._declare(Histogram, name, doc, labels, buckets=tuple(buckets))

    def value(self, name: str, labels: dict[str, str] | None = None) -> float | None:
        """A sample's current value (tests, status pages): e.g. `value("x_total", {...})`."""
        return self.registry.get_sample_value(self.full_name(name), labels or {})


def _lookup(registry: CollectorRegistry, full_name: str) -> Any:
    # prometheus_client keeps name -> collector privately; used only on re-declaration.
    names = getattr(registry, "_names_to_collectors", {})
    return names.get(full_name) or names.get(full_name + "_total")


class MetricsServer:
    """A running /metrics HTTP endpoint (prometheus_client's WSGI server on a thread)."""

    def __init__(self, server: Any, thread: Any) -> None:
        self._server = server
        self._thread = thread
        self.port: int = server.server_port

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def start_metrics_server(
    port: int, registry: CollectorRegistry | None = None, host: str = "127.0.0.1"
) -> MetricsServer | None:
    """Serve the registry at http://host:port/metrics. Port 0 = metrics off (returns None)."""
    if not port:
        return None
    reg = registry if registry is not None else prometheus_client.REGISTRY
    server, thread = prometheus_client.start_http_server(port, addr=host, registry=reg)
    _log.info("metrics server started", host=host, port=server.server_port)
    return MetricsServer(server, thread)


class MetricsInterceptor(WrappingInterceptor):
    """Per gRPC method: `pdserve_rpc_requests_total{method,code}`,
    `pdserve_rpc_latency_seconds{method}` (whole call, stream included) and
    `pdserve_rpc_in_flight{method}`. Placed outside ErrorInterceptor, so `code` is the
    status the client sees."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__()
        self.requests = metrics.counter("rpc_requests", "gRPC calls served", ("method", "code"))
        self.latency = metrics.histogram("rpc_latency_seconds", "gRPC call duration", ("method",))
        self.in_flight = metrics.gauge("rpc_in_flight", "gRPC calls in progress", ("method",))
        self._series: dict[tuple, Any] = {}  # labelled children, looked up once

    def _child(self, metric: Any, *labels: str) -> Any:
        key = (id(metric), *labels)
        child = self._series.get(key)
        if child is None:
            child = self._series[key] = metric.labels(*labels)
        return child

    def _done(self, method: str, start: float, code: grpc.StatusCode) -> None:
        self._child(self.latency, method).observe(time.perf_counter() - start)
        self._child(self.requests, method, code.name).inc()
        self._child(self.in_flight, method).dec()

    def wrap_unary(self, behavior: UnaryBehavior, call: grpc.HandlerCallDetails) -> UnaryBehavior:
        method = call.method

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            start = time.perf_counter()
            self._child(self.in_flight, method).inc()
            code = grpc.StatusCode.UNKNOWN
            try:
                result = await behavior(request, context)
                code = _code_of(context, None)
                return result
            except BaseException as exc:
                code = _code_of(context, exc)
                raise
            finally:
                self._done(method, start, code)

        return unary

    def wrap_stream(
        self, behavior: StreamBehavior, call: grpc.HandlerCallDetails
    ) -> StreamBehavior:
        method = call.method

        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            start = time.perf_counter()
            self._child(self.in_flight, method).inc()
            code = grpc.StatusCode.CANCELLED  # if the generator is closed early
            try:
                async with contextlib.aclosing(behavior(request, context)) as agen:
                    async for item in agen:
                        yield item
                code = _code_of(context, None)
            except BaseException as exc:
                code = _code_of(context, exc)
                raise
            finally:
                self._done(method, start, code)

        return stream


def _code_of(context: aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    try:
        code = context.code()
    except Exception:  # older grpc without ServicerContext.code()
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(code, int):  # some grpc versions return the raw C value
        for sc in grpc.StatusCode:
            if sc.value[0] == code:
                return sc
    return grpc.StatusCode.OK if exc is None else grpc.StatusCode.UNKNOWN
