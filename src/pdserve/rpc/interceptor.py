"""The one place where exceptions become gRPC status codes, and where the request id of an
incoming call is bound for logging.

ErrorInterceptor, for every async handler (unary and streaming, also mid-stream):
- `PdserveError` subclass -> its `code`, details = the message (str(exc));
- `grpc.aio.AioRpcError` from a downstream call whose code is UNAVAILABLE,
  RESOURCE_EXHAUSTED, DEADLINE_EXCEEDED or CANCELLED -> the same code ("dead or overloaded
  peer" stays meaningful end to end); any other downstream code -> INTERNAL;
- any other exception -> INTERNAL with `"<Type>: <message>"` (truncated), logged with
  its traceback;
- asyncio.CancelledError (client cancelled / deadline) and grpc's own AbortError (the
  servicer called context.abort itself) pass through untouched.
Servicers therefore raise domain errors and never catch to map them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Any, NoReturn

import grpc
from grpc import aio

from pdserve.errors import NoInstanceHereError, PdserveError
from pdserve.logging import get_logger, request_id_var
from pdserve.rpc._wrap import (
    StreamBehavior,
    UnaryBehavior,
    WrappingInterceptor,
)
from pdserve.rpc.ids import is_valid_id

REQUEST_ID_KEY = "x-request-id"
RETRY_AFTER_KEY = "retry-after"
# Trailing metadata on every status a pdserve service sends for an error it decided: the
# client can tell "the server answered UNAVAILABLE" (e.g. a router whose worker died past
# its migrations) from "the connection failed" (the server died: the SDK resumes elsewhere).
# The value "elsewhere" marks a router that has no instance left to continue a stream on: the
# SDK resumes it on a replica that has not said so.
ANSWERED_KEY = "pdserve-answered"
MAX_DETAILS = 300

_PASS_THROUGH = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.CANCELLED,
    }
)

_log = get_logger(__name__)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and details the client sees for `exc` (no side effects)."""
    if isinstance(exc, PdserveError):
        return exc.code, (str(exc) or type(exc).__name__)[:MAX_DETAILS]
    if isinstance(exc, aio.AioRpcError):
        code = exc.code()
        details = f"upstream {code.name}: {exc.details() or ''}"[:MAX_DETAILS]
        if code in _PASS_THROUGH:
            return code, details
        return grpc.StatusCode.INTERNAL, details
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return grpc.StatusCode.INTERNAL, f"internal error: {text}"[:MAX_DETAILS]


def retry_metadata(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """`retry-after: SECONDS` (whole seconds, at least 1) for an error that carries a retry
    hint (OverloadedError.retry_after_s); empty otherwise."""
    after = getattr(exc, "retry_after_s", None)
    if after is None:
        return ()
    return ((RETRY_AFTER_KEY, str(max(1, math.ceil(after)))),)


async def _abort(context: aio.ServicerContext, exc: Exception, method: str) -> NoReturn:
    code, details = status_for(exc)
    if isinstance(exc, PdserveError):
        _log.info("rpc failed", method=method, code=code.name, details=details)
    elif code is grpc.StatusCode.INTERNAL:
        _log.error("rpc crashed", method=method, code=code.name, exc_info=exc)
    else:
        _log.warning("rpc failed upstream", method=method, code=code.name, details=details)
    # "elsewhere": this router has no instance left; another replica may still have one
    verdict = "elsewhere" if isinstance(exc, NoInstanceHereError) else "1"
    trailing = (*retry_metadata(exc), (ANSWERED_KEY, verdict))
    await context.abort(code, details, trailing_metadata=trailing)  # raises
    raise AssertionError("context.abort returned")  # pragma: no cover


class ErrorInterceptor(WrappingInterceptor):
    """Maps exceptions raised by servicers onto status codes (see the module docstring)."""

    def wrap_unary(self, behavior: UnaryBehavior, call: grpc.HandlerCallDetails) -> UnaryBehavior:
        method = call.method

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            try:
                return await behavior(request, context)
            except (asyncio.CancelledError, aio.AbortError):
                raise
            except Exception as exc:
                await _abort(context, exc, method)

        return unary

    def wrap_stream(
        self, behavior: StreamBehavior, call: grpc.HandlerCallDetails
    ) -> StreamBehavior:
        method = call.method

        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                async with contextlib.aclosing(behavior(request, context)) as agen:
                    async for item in agen:
                        yield item
            except (asyncio.CancelledError, aio.AbortError):
                raise
            except Exception as exc:
                await _abort(context, exc, method)

        return stream


def request_id_in(context: aio.ServicerContext) -> str | None:
    """The `x-request-id` metadata value of the call being served, if any and valid (an id
    that is too long or has odd characters is ignored: it never reaches the logs)."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            text = value if isinstance(value, str) else value.decode("utf-8", "replace")
            return text if is_valid_id(text) else None
    return None


class RequestIdInterceptor(WrappingInterceptor):
    """Binds the `x-request-id` metadata of a call to `request_id_var` while its handler
    runs, so every log line of the call carries `request_id`. Calls without the metadata
    run with no request id (a service that mints ids binds its own)."""

    def wrap_unary(self, behavior: UnaryBehavior, call: grpc.HandlerCallDetails) -> UnaryBehavior:
        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            token = request_id_var.set(request_id_in(context))
            try:
                return await behavior(request, context)
            finally:
                request_id_var.reset(token)

        return unary

    def wrap_stream(
        self, behavior: StreamBehavior, call: grpc.HandlerCallDetails
    ) -> StreamBehavior:
        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            # An async generator runs in the context of the task that drives it: the call's
            # own task (one per RPC), so the value cannot leak into another call.
            token = request_id_var.set(request_id_in(context))
            try:
                async with contextlib.aclosing(behavior(request, context)) as agen:
                    async for item in agen:
                        yield item
            finally:
                with contextlib.suppress(ValueError):  # finalised from another context
                    request_id_var.reset(token)

        return stream


def server_interceptors(*extra: aio.ServerInterceptor) -> list[aio.ServerInterceptor]:
    """The standard chain, outermost first: undecodable bodies refused, request id, `extra`
    (e.g. authorization, metrics), errors. The error interceptor is innermost so the others
    see mapped status codes."""
    from pdserve.rpc.decode_guard import DecodeGuardInterceptor

    return [DecodeGuardInterceptor(), RequestIdInterceptor(), *extra, ErrorInterceptor()]
