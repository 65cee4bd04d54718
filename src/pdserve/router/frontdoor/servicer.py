"""gRPC servicer of the public plane: Router (Generate, Status) for clients; proto <->
domain only (the domain path lives in door.py). Domain errors raised here are mapped to
status codes by pdserve.rpc's ErrorInterceptor. The internal plane's Registry servicer is
cluster/servicer.py."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from pdserve.logging import get_logger
from pdserve.v1 import router_pb2, router_pb2_grpc

from .auth import metadata_value
from .door import FrontDoor

log = get_logger("pdserve.router")


ORACLE_METADATA = "pdserve-oracle-tokens"


def oracle_tokens(context) -> int:
    """The true output length a benchmark request carries (metadata); honored by the
    length scheduling only when the router runs with predictor_oracle."""
    try:
        for key, value in context.invocation_metadata() or ():
            if key == ORACLE_METADATA:
                return max(0, int(value))
    except (AttributeError, TypeError, ValueError):
        return 0
    return 0


class RouterServicer(router_pb2_grpc.RouterServicer):
    """The gRPC front door: the API key from the call's metadata, then the shared domain
    path (FrontDoor), which the OpenAI HTTP API uses too."""

    def __init__(self, front: FrontDoor) -> None:
        self.front = front

    async def Generate(
        self, request: router_pb2.GenerateRequest, context
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        key = self.front.authenticate(metadata_value(context.invocation_metadata()))
        oracle = oracle_tokens(context)
        async with contextlib.aclosing(self.front.generate(request, key, oracle)) as stream:
            async for resp in stream:
                yield resp

    async def Resume(
        self, request: router_pb2.ResumeRequest, context
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        key = self.front.authenticate(metadata_value(context.invocation_metadata()))
        async with contextlib.aclosing(self.front.resume(request, key)) as stream:
            async for resp in stream:
                yield resp

    async def Status(self, request: router_pb2.StatusRequest, context) -> router_pb2.StatusResponse:
        self.front.authenticate(metadata_value(context.invocation_metadata()))
        return self.front.status()
