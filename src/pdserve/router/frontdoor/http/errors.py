"""Exceptions -> HTTP status and OpenAI error bodies. The status code comes from the same
`status_for` the gRPC ErrorInterceptor uses, so both front doors agree on every error."""

from __future__ import annotations

import math
from typing import Any

import grpc
from starlette.responses import JSONResponse

from pdserve.errors import InvalidRequestError
from pdserve.rpc.interceptor import status_for

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable",
    504: "timeout",
}
# GenerateRequest field (as the domain names it) -> the OpenAI parameter
OPENAI_PARAM = {"token_ids.ids": "prompt", "chat": "messages", "text": "prompt"}


def error_body(exc: BaseException, chat: bool = False) -> tuple[int, dict[str, Any]]:
    code, message = status_for(exc)
    status = HTTP_STATUS.get(code, 500)
    param = None
    if isinstance(exc, InvalidRequestError):
        param = OPENAI_PARAM.get(exc.field, exc.field)
        if param == "prompt" and chat:
            param = "messages"
        rest = str(exc).removeprefix(f"{exc.field}: ")
        message = f"{param}: {rest}"
    body = {
        "error": {
            "message": message,
            "type": ERROR_TYPE.get(status, "server_error"),
            "param": param,
            "code": code.name.lower(),
        }
    }
    return status, body


def error_response(exc: BaseException, chat: bool = False) -> JSONResponse:
    status, body = error_body(exc, chat)
    headers = {}
    after = getattr(exc, "retry_after_s", None)
    if status == 429:
        headers["retry-after"] = str(max(1, math.ceil(after if after is not None else 1)))
    return JSONResponse(body, status_code=status, headers=headers)
