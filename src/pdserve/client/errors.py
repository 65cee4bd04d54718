"""Typed client errors, mapped from gRPC status codes. Each carries the server's
message (`message`) and the status code (`code`)."""

from __future__ import annotations

import grpc


class PdserveClientError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after_s: float | None = None  # the server's retry hint, when it sent one
        # True: the server decided this status; False: the call failed on the way (the
        # connection broke, nothing listens, the server was still starting)
        self.answered = False
        # the server answered that another replica may do better (it has no instance left)
        self.elsewhere = False
        if code is not None:
            self.code = code


class InvalidArgument(PdserveClientError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(PdserveClientError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(PdserveClientError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(PdserveClientError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(PdserveClientError):
    code = grpc.StatusCode.CANCELLED


class Internal(PdserveClientError):
    code = grpc.StatusCode.INTERNAL


class Unauthenticated(PdserveClientError):
    """The router wants an API key (`api_key=` / PDSERVE_CLIENT_API_KEY) and got none or a wrong one."""

    code = grpc.StatusCode.UNAUTHENTICATED


class NotFound(PdserveClientError):
    """Unknown request or stream (e.g. a resume the cluster never issued)."""

    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(PdserveClientError):
    """Not yours: e.g. a stream started with another API key."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(PdserveClientError):
    """The state forbids it: e.g. resuming a stream that already finished."""

    code = grpc.StatusCode.FAILED_PRECONDITION


_BY_CODE: dict[grpc.StatusCode, type[PdserveClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
        Unauthenticated,
        NotFound,
        PermissionDenied,
        FailedPrecondition,
    )
}


def from_rpc_error(err: grpc.RpcError) -> PdserveClientError:
    """The typed exception for a failed call (base class for unmapped codes)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    cls = _BY_CODE.get(code, PdserveClientError)
    error = cls(details, code)
    trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in trailing or ():
        if key == "retry-after":
            error.retry_after_s = float(value)
        elif key == "pdserve-answered":
            error.answered = True
            error.elsewhere = value == "elsewhere"
    return error
