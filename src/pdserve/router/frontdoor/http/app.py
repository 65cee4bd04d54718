"""The OpenAI-compatible HTTP front door (Starlette): POST /v1/chat/completions,
POST /v1/completions (SSE streaming or one JSON), GET /v1/models, GET /health.

Every generation goes through `FrontDoor.generate`, the path the gRPC Router service uses:
the key is checked, the request admitted, validated, orchestrated and detokenized there.
Errors before the first token get their HTTP status (400/401/429/503...); an error after it
(the SSE response has started) is sent as a final `data: {"error": ...}` event.

A client that disconnects cancels its request at any stage: while it waits for its first
token (either kind) and while a non-streaming answer is being generated (`_unless_gone`
watches the connection), and during an SSE stream (Starlette cancels the body iterator).
The front door then aborts the request on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from pdserve.errors import InvalidRequestError, NotFoundError, UnavailableError
from pdserve.logging import get_logger
from pdserve.v1 import router_pb2

from ..auth import AUTH_HEADER
from ..door import FrontDoor
from .errors import error_body, error_response
from .openai import ChatRequest, CompletionRequest, Shaper, parse

log = get_logger("pdserve.router.frontdoor.http")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
CLIENT_CLOSED = 499  # (nginx's code) nobody reads it: the client is gone


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


async def _disconnected(request: Request) -> None:
    """Return once the client disconnects (call after the body has been read: the next ASGI
    message is then `http.disconnect`)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def _unless_gone(request: Request) -> AsyncIterator[None]:
    """Run the block; if the client disconnects meanwhile, cancel it (at its current await:
    the front door then aborts the request) and raise ClientGone. The block stays in the
    handler's task, so the request id bound in its context stays bound."""
    handler = asyncio.current_task()
    assert handler is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        await _disconnected(request)
        gone = True
        handler.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        yield
    except asyncio.CancelledError:
        if not gone:
            raise
        handler.uncancel()
        raise ClientGone from None
    finally:
        watcher.cancel()  # (no await since the block ended: the watcher cannot fire late)


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class BodyTooLarge(Exception):
    """A request body over the limit (HTTP 413); raised before it is read whole."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"body: the request body is larger than {limit} bytes (--max-request-bytes)"
        )


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, at most `limit` bytes: a declared Content-Length over it is
    refused before any byte is read, and a body without one (chunked) is counted while it
    streams and refused as soon as it passes the limit. Never holds more than `limit`
    bytes (plus one chunk)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise BodyTooLarge(limit)
        except ValueError:
            raise InvalidRequestError("body", "bad Content-Length header") from None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BodyTooLarge(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(exc: BodyTooLarge) -> Response:
    body = {
        "error": {
            "message": str(exc),
            "type": "invalid_request_error",
            "param": "body",
            "code": "request_too_large",
        }
    }
    return JSONResponse(body, status_code=413, headers={"connection": "close"})


class OpenAIApp:
    def __init__(self, front: FrontDoor, max_body_bytes: int = 16 << 20) -> None:
        self.front = front
        self.max_body_bytes = max_body_bytes  # --max-request-bytes, as on the gRPC door
        self.started = int(time.time())
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
            ]
        )

    @property
    def model_name(self) -> str:
        return self.front.model.name or "pdserve"

    # ------------------------------------------------------------- routes
    async def health(self, request: Request) -> Response:
        if self.front.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        serving = sum(1 for i in self.front.registry.instances() if i.state == "serving")
        return JSONResponse({"status": "ok", "instances": serving})

    async def models(self, request: Request) -> Response:
        try:
            self.front.authenticate(request.headers.get(AUTH_HEADER))
        except Exception as exc:
            return error_response(exc)
        _, context = self.front.model.known_limits
        card = {
            "id": self.model_name,
            "object": "model",
            "created": self.started,
            "owned_by": "pdserve",
            "max_model_len": context or None,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, ChatRequest, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, CompletionRequest, "text")

    # ------------------------------------------------------------ helpers
    async def _generate(self, request: Request, model: type, kind: str) -> Response:
        chat = kind == "chat"
        try:
            key = self.front.authenticate(request.headers.get(AUTH_HEADER))
            raw = await read_body(request, self.max_body_bytes)  # before any parsing
            try:
                body = json.loads(raw)
            except ValueError:
                raise InvalidRequestError("body", "is not valid JSON") from None
            req = parse(model, body)
            if req.model and req.model != self.model_name:
                raise NotFoundError(
                    f"model {req.model!r} is not served here; GET /v1/models lists "
                    f"{self.model_name!r}"
                )
            grpc_req = req.to_request()
            stream = self.front.generate(grpc_req, key)
            try:
                async with _unless_gone(request):
                    first = await anext(stream)
            except StopAsyncIteration:
                raise UnavailableError("the request ended without a response") from None
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except BodyTooLarge as exc:
            log.info("request body too large", limit=self.max_body_bytes)
            return _too_large(exc)
        except Exception as exc:
            return error_response(exc, chat)
        shaper = Shaper(kind, self.model_name, first.request_id, req.return_token_ids)  # type: ignore[arg-type]
        if req.stream:
            return StreamingResponse(
                self._sse(shaper, first, stream, req.include_usage, chat),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        try:
            async with _unless_gone(request):
                return await self._whole(shaper, first, stream, chat)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)

    async def _whole(
        self,
        shaper: Shaper,
        first: router_pb2.GenerateResponse,
        stream: AsyncIterator[router_pb2.GenerateResponse],
        chat: bool,
    ) -> Response:
        text, ids, last = [first.text], list(first.token_ids), first
        try:
            async with contextlib.aclosing(stream):
                async for resp in stream:
                    text.append(resp.text)
                    ids.extend(resp.token_ids)
                    last = resp
        except Exception as exc:
            return error_response(exc, chat)
        return JSONResponse(shaper.whole("".join(text), ids, last.finish_reason, last.usage))

    async def _sse(
        self,
        shaper: Shaper,
        first: router_pb2.GenerateResponse,
        stream: AsyncIterator[router_pb2.GenerateResponse],
        include_usage: bool,
        chat: bool,
    ) -> AsyncIterator[bytes]:
        async with contextlib.aclosing(stream):
            if chat:  # OpenAI's first chat chunk carries the role
                yield _sse(shaper.chunk("", [], 0, first=True))
            resp = first
            try:
                while True:
                    if resp.text or resp.token_ids or resp.finish_reason:
                        yield _sse(
                            shaper.chunk(resp.text, list(resp.token_ids), resp.finish_reason)
                        )
                    if resp.finish_reason:
                        if include_usage:
                            yield _sse(shaper.usage_chunk(resp.usage))
                        break
                    resp = await anext(stream)
            except StopAsyncIteration:
                pass
            except Exception as exc:  # the response has started: report in-band
                status, body = error_body(exc, chat)
                log.info("stream failed", status=status, error=body["error"]["message"])
                yield _sse(body)
        yield b"data: [DONE]\n\n"
