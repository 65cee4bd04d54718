"""Health checks against the standard grpc.health.v1 service every pdserve service runs."""

from __future__ import annotations

import grpc
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.rpc.tls import TlsFiles, secure_channel_sync

_SERVING = health_pb2.HealthCheckResponse.SERVING


def check_health(
    addr: str, timeout: float = 2.0, service: str = "", tls: TlsFiles | None = None
) -> bool:
    """Blocking: True if HOST:PORT answers SERVING for `service` ("" = the whole server)
    within `timeout` seconds; False when it is NOT_SERVING, unknown, or unreachable.
    `tls`: the certificate to present to an internal (mutual TLS) listener."""
    try:
        channel_cm = grpc.insecure_channel(addr) if tls is None else secure_channel_sync(addr, tls)
        with channel_cm as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
            )
    except grpc.RpcError:
        return False
    return reply.status == _SERVING


async def check_health_async(addr: str, timeout: float = 2.0, service: str = "") -> bool:
    """Same as check_health, for asyncio code (never blocks the loop)."""
    try:
        async with aio.insecure_channel(addr) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout, wait_for_ready=True
            )
    except grpc.RpcError:
        return False
    return reply.status == _SERVING
