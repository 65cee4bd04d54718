"""Undecodable request bodies -> INVALID_ARGUMENT, one log line, no traceback.

grpc's own handling of a deserializer that raises is an INTERNAL status and a logged
traceback per call, so an anonymous client could flood the logs. DecodeGuardInterceptor
swaps each handler's request deserializer for one that returns an `Undecodable` marker
instead of raising (protobuf raises on truncated fields, wrong wire types and invalid UTF-8
in string fields), and the wrapped behaviour turns the marker into INVALID_ARGUMENT.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc import aio

from pdserve.logging import get_logger
from pdserve.rpc._wrap import StreamBehavior, UnaryBehavior, WrappingInterceptor

_log = get_logger(__name__)


@dataclass(frozen=True)
class Undecodable:
    error: str


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:
            return Undecodable(f"{type(exc).__name__}: {exc}"[:200])

    return decode


async def _refuse(context: aio.ServicerContext, method: str, bad: Undecodable) -> None:
    _log.info("undecodable request", method=method, error=bad.error)
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"request body does not decode: {bad.error}"
    )


class DecodeGuardInterceptor(WrappingInterceptor):
    def _rewrap(
        self, h: grpc.RpcMethodHandler, method: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler:
        if h.request_streaming:  # (Worker.Streams only: router-only, internal; left as it is)
            return h
        h = h._replace(request_deserializer=_safe(h.request_deserializer))  # type: ignore[attr-defined]
        return super()._rewrap(h, method)

    def wrap_unary(self, behavior: UnaryBehavior, call: grpc.HandlerCallDetails) -> UnaryBehavior:
        method = call.method

        async def unary(request: Any, context: aio.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                await _refuse(context, method, request)
            return await behavior(request, context)

        return unary

    def wrap_stream(
        self, behavior: StreamBehavior, call: grpc.HandlerCallDetails
    ) -> StreamBehavior:
        method = call.method

        async def stream(request: Any, context: aio.ServicerContext) -> AsyncIterator[Any]:
            if isinstance(request, Undecodable):
                await _refuse(context, method, request)
            async with contextlib.aclosing(behavior(request, context)) as agen:
                async for item in agen:
                    yield item

        return stream
