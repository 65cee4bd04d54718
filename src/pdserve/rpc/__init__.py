"""gRPC plumbing shared by every service: server lifecycle, error and request-id
interceptors, metrics, channels, health. Stub generation: `python -m pdserve.rpc.codegen`."""

from pdserve.rpc.channels import ChannelPool, make_channel, metadata_with_request_id
from pdserve.rpc.health import check_health, check_health_async
from pdserve.rpc.interceptor import REQUEST_ID_KEY, ErrorInterceptor, RequestIdInterceptor
from pdserve.rpc.metrics import Metrics, MetricsInterceptor, start_metrics_server
from pdserve.rpc.ready import READY_PREFIX, parse_ready_line
from pdserve.rpc.server import ServiceApp, ServiceRunner, install_event_loop, run_service, serve

__all__ = [
    "READY_PREFIX",
    "REQUEST_ID_KEY",
    "ChannelPool",
    "ErrorInterceptor",
    "Metrics",
    "MetricsInterceptor",
    "RequestIdInterceptor",
    "ServiceApp",
    "ServiceRunner",
    "check_health",
    "check_health_async",
    "install_event_loop",
    "make_channel",
    "metadata_with_request_id",
    "parse_ready_line",
    "run_service",
    "serve",
    "start_metrics_server",
]
