"""Domain errors. Each carries the gRPC status it maps to; the one place that
maps them onto the wire is `pdserve.rpc.interceptor`. Torch-free."""

from __future__ import annotations

import grpc


class PdserveError(Exception):
    """Base of every error pdserve raises on purpose."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidRequestError(PdserveError, ValueError):
    """Bad input. `field` names the offending field; the message names the allowed range."""

    code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class OverloadedError(PdserveError):
    """Back-pressure: no room now, try later or elsewhere."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(PdserveError):
    """A peer is dead, draining, or not registered."""

    code = grpc.StatusCode.UNAVAILABLE


class DeadlineError(PdserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class NotFoundError(PdserveError):
    """Unknown request, ticket or session."""

    code = grpc.StatusCode.NOT_FOUND


class FailedPreconditionError(PdserveError):
    """The system is not in a state that allows the call (e.g. KV layout mismatch)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ModelLoadError(PdserveError):
    """Unsupported architecture, missing file, or weights that do not match the config."""

    code = grpc.StatusCode.FAILED_PRECONDITION
