"""Shared machinery of our server interceptors: wrap a method handler's behaviour function.

grpc.aio interceptors only see `handler_call_details` and the handler; to act on what a
call raises or returns they must replace the behaviour. One rule for all four call kinds:
- unary response (unary_unary, stream_unary, and streaming handlers written as coroutines
  that call `context.write`): `wrap_unary(behavior)` must return a coroutine function;
- streaming response written as an async generator: `wrap_stream(behavior)` must return an
  async generator function.
Synchronous behaviours (grpc's thread-pool handlers) are left as they are: pdserve does not
use them. Stream wrappers iterate the inner generator under `contextlib.aclosing`, so its
`finally` blocks (e.g. abort the engine request) run as soon as the call ends, not at
garbage collection.

A wrapper depends on the method only (what varies per call, e.g. its metadata, it reads
from the call's context), so each interceptor wraps a method's handler once and reuses it:
rebuilding the handler per call (inspect checks, new handler tuples) cost about half of
grpc's own per-call cost (benchmarks/grpc_floor.py).
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
from grpc import aio

UnaryBehavior = Callable[[Any, aio.ServicerContext], Awaitable[Any]]
StreamBehavior = Callable[[Any, aio.ServicerContext], AsyncIterator[Any]]


def _is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn)


class WrappingInterceptor(aio.ServerInterceptor, abc.ABC):
    """Base: subclasses say how to wrap one behaviour; this class rebuilds the handler."""

    def __init__(self) -> None:
        # (method, id of the inner handler) -> (that handler, its wrapped handler)
        self._wrapped: dict[tuple[str, int], tuple[grpc.RpcMethodHandler, Any]] = {}

    @abc.abstractmethod
    def wrap_unary(self, behavior: UnaryBehavior, call: grpc.HandlerCallDetails) -> UnaryBehavior:
        """Return a coroutine function (request_or_iterator, context) -> response."""

    @abc.abstractmethod
    def wrap_stream(
        self, behavior: StreamBehavior, call: grpc.HandlerCallDetails
    ) -> StreamBehavior:
        """Return an async generator function (request_or_iterator, context) -> responses."""

    def applies_to(self, call: grpc.HandlerCallDetails) -> bool:
        """False leaves this call's handler untouched."""
        return True

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        # None = unknown method: grpc answers UNIMPLEMENTED
        if handler is None or not self.applies_to(handler_call_details):
            return handler
        key = (handler_call_details.method, id(handler))
        cached = self._wrapped.get(key)
        if cached is None or cached[0] is not handler:  # (kept: its id is not reused)
            cached = self._wrapped[key] = (handler, self._rewrap(handler, handler_call_details))
        return cached[1]

    def _pick(self, behavior: Any, call: grpc.HandlerCallDetails) -> Any:
        if behavior is None or not _is_async(behavior):
            return behavior
        if inspect.isasyncgenfunction(behavior):
            return self.wrap_stream(behavior, call)
        return self.wrap_unary(behavior, call)

    def _rewrap(
        self, h: grpc.RpcMethodHandler, method: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        de, ser = h.request_deserializer, h.response_serializer
        if h.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._pick(h.unary_unary, method), request_deserializer=de, response_serializer=ser
            )
        if h.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._pick(h.unary_stream, method), request_deserializer=de, response_serializer=ser
            )
        if h.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._pick(h.stream_unary, method), request_deserializer=de, response_serializer=ser
            )
        if h.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._pick(h.stream_stream, method),
                request_deserializer=de,
                response_serializer=ser,
            )
        return h
