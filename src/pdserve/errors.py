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
    """Back-pressure: no room now, try later or elsewhere. `retry_after_s`, when known, is
    sent to clients as a hint (gRPC trailing metadata `retry-after`, HTTP `Retry-After`)."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, message: str = "", retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class UnauthenticatedError(PdserveError):
    """No API key, or one the router does not know."""

    code = grpc.StatusCode.UNAUTHENTICATED


class UnavailableError(PdserveError):
    """A peer is dead, draining, or not registered."""

    code = grpc.StatusCode.UNAVAILABLE


class NoInstanceHereError(UnavailableError):
    """This router has no instance to continue a stream on (its workers died or it is cut off
    from them). Another replica may still reach some: the error is marked "elsewhere", and
    the SDK resumes the stream on a router that has not said so (with one router, it fails)."""


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


class PermissionDeniedError(PdserveError):
    """The authenticated peer may not do this (wrong role, someone else's instance)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class AlreadyExistsError(PdserveError):
    """A request id that is already in flight."""

    code = grpc.StatusCode.ALREADY_EXISTS
