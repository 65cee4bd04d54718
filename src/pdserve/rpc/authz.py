"""Who may call what on the internal plane: one table, one interceptor.

The peer's role comes from its verified client certificate (`pdserve.rpc.tls.peer_identity`).
A method is looked up in METHOD_ROLES, then its service in SERVICE_ROLES (the fallback for a
method added later without a rule: the narrowest sensible set), and anything else is denied.
A refused call gets PERMISSION_DENIED naming the method and the peer, and one log line.

While a handler runs, `current_peer()` returns the caller's identity (servicers use it to
bind a registration or a kvstore put to its maker).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import AsyncIterator, Mapping
from typing import Any

import grpc
from grpc import aio

from pdserve.logging import get_logger
from pdserve.rpc._wrap import StreamBehavior, UnaryBehavior, WrappingInterceptor
from pdserve.rpc.certs import ROLES, Identity
from pdserve.rpc.tls import peer_identity

_log = get_logger(__name__)

ROUTER, WORKER, KVSTORE, ADMIN = "router", "worker", "kvstore", "admin"
ANY = frozenset(ROLES)

METHOD_ROLES: Mapping[str, frozenset[str]] = {
    # the registry: workers register themselves and report their load
    "/pdserve.v1.Registry/Register": frozenset({WORKER}),
    "/pdserve.v1.Registry/Heartbeat": frozenset({WORKER}),
    "/pdserve.v1.Registry/Deregister": frozenset({WORKER}),
    # worker control: only the router
    "/pdserve.v1.Worker/Prefill": frozenset({ROUTER}),
    "/pdserve.v1.Worker/Decode": frozenset({ROUTER}),  # reserves too (no Reserve method)
    "/pdserve.v1.Worker/Generate": frozenset({ROUTER}),
    "/pdserve.v1.Worker/Streams": frozenset({ROUTER}),  # Decode and Generate streams, many per call
    "/pdserve.v1.Worker/Abort": frozenset({ROUTER}),
    "/pdserve.v1.Worker/SetRole": frozenset({ROUTER}),
    "/pdserve.v1.Worker/Drain": frozenset({ROUTER}),
    "/pdserve.v1.Worker/Info": frozenset({ROUTER, ADMIN}),
    # kvstore: workers read and write blocks; operators inspect and purge
    "/pdserve.v1.KVStore/Lookup": frozenset({WORKER}),
    "/pdserve.v1.KVStore/Fetch": frozenset({WORKER}),
    "/pdserve.v1.KVStore/BeginPut": frozenset({WORKER}),
    "/pdserve.v1.KVStore/CommitPut": frozenset({WORKER}),
    "/pdserve.v1.KVStore/Pin": frozenset({WORKER}),
    "/pdserve.v1.KVStore/Unpin": frozenset({WORKER}),
    "/pdserve.v1.KVStore/Stats": frozenset({WORKER, ROUTER, ADMIN}),
    "/pdserve.v1.KVStore/Clear": frozenset({ADMIN}),
    "/pdserve.v1.KVStore/PurgeWriter": frozenset({ADMIN}),
}

SERVICE_ROLES: Mapping[str, frozenset[str]] = {
    "grpc.health.v1.Health": ANY,
    "pdserve.v1.Registry": frozenset({WORKER}),
    "pdserve.v1.Worker": frozenset({ROUTER}),
    "pdserve.v1.KVStore": frozenset({ADMIN}),
}

_peer: contextvars.ContextVar[Identity | None] = contextvars.ContextVar(
    "pdserve_peer", default=None
)


def current_peer() -> Identity | None:
    """The identity of the peer whose call is being served (None: plaintext / no TLS)."""
    return _peer.get()


def allowed_roles(method: str) -> frozenset[str]:
    if method in METHOD_ROLES:
        return METHOD_ROLES[method]
    service = method.lstrip("/").partition("/")[0]
    return SERVICE_ROLES.get(service, frozenset())


def authorize(method: str, peer: Identity | None) -> str | None:
    """None when `peer` may call `method`; else the reason for PERMISSION_DENIED."""
    if peer is None:
        return f"{method}: no pdserve client certificate"
    roles = allowed_roles(method)
    if peer.role not in roles:
        allowed = ", ".join(sorted(roles)) or "nobody"
        return f"{method}: role {peer.role!r} may not call it (allowed: {allowed})"
    return None


class AuthzInterceptor(WrappingInterceptor):
    """PERMISSION_DENIED unless the caller's certificate role is allowed for the method."""

    async def _check(self, context: aio.ServicerContext, method: str) -> Identity:
        peer = peer_identity(context)
        reason = authorize(method, peer)
        if reason is not None:
            _log.warning("call refused", method=method, peer=str(peer) if peer else None)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        assert peer is not None
        return peer

    def wrap_unary(self, behavior: UnaryBehavior, call: grpc.HandlerCallDetails) -> UnaryBehavior:
        method = call.method

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            token = _peer.set(await self._check(context, method))
            try:
                return await behavior(request, context)
            finally:
                _peer.reset(token)

        return unary

    def wrap_stream(
        self, behavior: StreamBehavior, call: grpc.HandlerCallDetails
    ) -> StreamBehavior:
        method = call.method

        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            token = _peer.set(await self._check(context, method))
            try:
                async with contextlib.aclosing(behavior(request, context)) as agen:
                    async for item in agen:
                        yield item
            finally:
                with contextlib.suppress(ValueError):
                    _peer.reset(token)

        return stream
