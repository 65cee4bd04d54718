"""Logging set-up: structlog for our code, stdlib logging (grpc, libraries) routed through the
same processors, one line per event on stderr (stdout is kept for machine-readable lines
such as `PDSERVE_READY`).

    configure_logging(fmt="json", level="info", service="router")
    log = get_logger(__name__)
    token = bind_request_id("req-1")      # every line logged in this task carries request_id
    log.info("admitted", prompt_tokens=12)
    reset_request_id(token)

The request id lives in `request_id_var` (a ContextVar): asyncio tasks copy the context when
they are created, so tasks spawned inside a request inherit its id, and concurrent requests
never see each other's. Other per-task fields can be bound with
`structlog.contextvars.bind_contextvars(...)`; they are merged into every line as well.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from contextvars import ContextVar, Token
from typing import IO, Any, Literal

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

__all__ = [
    "bind_request_id",
    "configure_logging",
    "current_request_id",
    "get_logger",
    "request_id_context",
    "request_id_var",
    "reset_request_id",
]

# The request being served by the current task (None outside a request).
request_id_var: ContextVar[str | None] = ContextVar("pdserve_request_id", default=None)

_HANDLER_MARK = "_pdserve_handler"


def bind_request_id(request_id: str | None) -> Token[str | None]:
    """Set the current task's request id; returns a token for `reset_request_id`."""
    return request_id_var.set(request_id or None)


def reset_request_id(token: Token[str | None]) -> None:
    request_id_var.reset(token)


def current_request_id() -> str | None:
    return request_id_var.get()


@contextlib.contextmanager
def request_id_context(request_id: str | None) -> Iterator[None]:
    """`with request_id_context(rid): ...` binds the id for the block only."""
    token = bind_request_id(request_id)
    try:
        yield
    finally:
        reset_request_id(token)


def _add_request_id(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
    rid = request_id_var.get()
    if rid is not None:
        event.setdefault("request_id", rid)
    return event


def _add_static(fields: dict[str, Any]) -> Processor:
    def add(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
        for key, value in fields.items():
            event.setdefault(key, value)
        return event

    return add


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever sys.stderr is at emit time (test runners swap it)."""

    @property  # type: ignore[override]
    def stream(self) -> IO[str]:
        return sys.stderr

    @stream.setter
    def stream(self, _value: IO[str]) -> None:  # StreamHandler.__init__ assigns it
        pass


def configure_logging(
    fmt: Literal["json", "console"] = "json",
    level: str | int = "info",
    service: str | None = None,
    *,
    instance_id: str | None = None,
    stream: IO[str] | None = None,
) -> None:
    """Configure structlog and the stdlib root logger for this process (idempotent: a second
    call replaces the first). `stream` defaults to the current sys.stderr."""
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be 'json' or 'console', got {fmt!r}")
    level_no = level if isinstance(level, int) else logging.getLevelName(level.upper())
    if not isinstance(level_no, int):
        raise ValueError(f"unknown log level {level!r}")

    static: dict[str, Any] = {}
    if service:
        static["service"] = service
    if instance_id:
        static["instance_id"] = instance_id

    # Shared by structlog events and by records from stdlib loggers ("foreign" records).
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        _add_request_id,
        _add_static(static),
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Processor
    if fmt == "json":
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer(default=str)
    else:
        out = stream if stream is not None else sys.stderr
        renderer = structlog.dev.ConsoleRenderer(colors=bool(getattr(out, "isatty", bool)()))

    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        # Not cached: a later configure_logging() also applies to loggers already in use.
        cache_logger_on_first_use=False,
    )

    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=shared,
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
    )
    handler: logging.Handler = (
        logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    )
    handler.setFormatter(formatter)
    setattr(handler, _HANDLER_MARK, True)

    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _HANDLER_MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level_no)


def debug_enabled(name: str) -> Callable[[], bool]:
    """Whether DEBUG lines of logger `name` are emitted now (the stdlib logger's own check,
    as structlog's filter_by_level makes it; it follows later level changes). Guards a
    DEBUG line on a hot path: a dropped structlog call still builds a bound logger."""
    return functools.partial(logging.getLogger(name).isEnabledFor, logging.DEBUG)


def get_logger(name: str | None = None, **initial: Any) -> structlog.stdlib.BoundLogger:
    """A structlog logger named `name` (usually __name__), optionally with bound fields."""
    logger: structlog.stdlib.BoundLogger = structlog.stdlib.get_logger(name)
    return logger.bind(**initial) if initial else logger
