"""Typed client errors, mapped from gRPC status codes. Each carries the server's
message (`message`) and the status code (`code`)."""

from __future__ import annotations

import grpc


class PdserveClientError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
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


_BY_CODE: dict[grpc.StatusCode, type[PdserveClientError]] = {
    cls.code: cls
    for cls in (
        InvalidArgument,
        ResourceExhausted,
        Unavailable,
        DeadlineExceeded,
        Cancelled,
        Internal,
    )
}


def from_rpc_error(err: grpc.RpcError) -> PdserveClientError:
    """The typed exception for a failed call (base class for unmapped codes)."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    cls = _BY_CODE.get(code, PdserveClientError)
    return cls(details, code)
