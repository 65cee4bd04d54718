"""Servicer registration on a server that is already running.

The lifecycle starts the gRPC server first (so health answers NOT_SERVING while the app
loads) and only then calls app.start(server), but grpc only allows registering handlers
before start. LateHandlers is registered before start; AppServer is what app.start()
receives: it forwards everything to the real server except registration, which lands in
LateHandlers and is looked up at call time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
from grpc import aio

STARTING = "the service is starting: not serving yet (retry)"


async def _refuse_starting(request: Any, context: Any) -> None:
    await context.abort(grpc.StatusCode.UNAVAILABLE, STARTING)


# Any method's answer while the app starts: no message, status UNAVAILABLE (retryable),
# whatever the method's arity (the request is read as raw bytes and never parsed).
_STARTING_HANDLER = grpc.unary_unary_rpc_method_handler(_refuse_starting)


class LateHandlers(grpc.GenericRpcHandler):
    """Registered on the server before it starts; servicers added later (by app.start,
    while health already answers) are looked up here at call time. Until the runner sets
    `ready` (app.start returned), a call its plane serves but finds no handler for is
    UNAVAILABLE, not UNIMPLEMENTED: a restarting service is busy, not missing a method, and
    clients retry it (e.g. the SDK on a router the supervisor just restarted)."""

    def __init__(self) -> None:
        self.by_service: dict[str, dict[str, grpc.RpcMethodHandler]] = {}
        self.generic: list[grpc.GenericRpcHandler] = []
        self.ready = False

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        # method = "/package.Service/Method"
        service, _, method = handler_call_details.method.lstrip("/").partition("/")
        found = self.by_service.get(service, {}).get(method)
        if found is not None:
            return found
        for handler in self.generic:
            found = handler.service(handler_call_details)
            if found is not None:
                return found
        return None


class PlaneHandlers(grpc.GenericRpcHandler):
    """One plane's view of LateHandlers: only the services `serves(name)` accepts (a method
    of any other service is UNIMPLEMENTED on this server, as if it did not exist)."""

    def __init__(self, late: LateHandlers, serves: Callable[[str], bool]) -> None:
        self._late = late
        self._serves = serves

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> Any:
        service = handler_call_details.method.lstrip("/").partition("/")[0]
        if not self._serves(service):
            return None
        found = self._late.service(handler_call_details)
        if found is None and not self._late.ready:
            return _STARTING_HANDLER
        return found


class AppServer:
    """The `server` app.start() receives: the running aio.Server, except that servicer
    registration goes to LateHandlers (grpc only allows it before start)."""

    def __init__(self, server: aio.Server, late: LateHandlers) -> None:
        self._server = server
        self._late = late

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._late.generic.extend(handlers)

    def add_registered_method_handlers(
        self, service_name: str, method_handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._late.by_service.setdefault(service_name, {}).update(method_handlers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)
