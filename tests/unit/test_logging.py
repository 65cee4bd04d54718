"""configure_logging: JSON/console output, stdlib routing, request_id through contextvars."""

from __future__ import annotations

import asyncio
import io
import json
import logging

import pytest

from pdserve.logging import (
    bind_request_id,
    configure_logging,
    current_request_id,
    get_logger,
    request_id_context,
    reset_request_id,
)


def _lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines() if line.strip()]


def test_json_lines_carry_service_level_and_fields(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("json", "info", service="toy", stream=buf)
    log = get_logger("pdserve.test")
    log.info("hello", blocks=3)
    log.debug("hidden")
    (line,) = _lines(buf)
    assert line["event"] == "hello"
    assert line["blocks"] == 3
    assert line["service"] == "toy"
    assert line["level"] == "info"
    assert line["logger"] == "pdserve.test"
    assert "timestamp" in line
    assert "request_id" not in line


def test_stdlib_records_are_rendered_too(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("json", "warning", service="toy", stream=buf)
    logging.getLogger("some.library").warning("disk %s", "full")
    logging.getLogger("some.library").info("dropped")
    (line,) = _lines(buf)
    assert line["event"] == "disk full"
    assert line["logger"] == "some.library"


def test_request_id_bound_and_reset(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    log = get_logger("t")
    token = bind_request_id("req-1")
    log.info("inside")
    logging.getLogger("lib").info("stdlib inside")
    reset_request_id(token)
    log.info("outside")
    with request_id_context("req-2"):
        assert current_request_id() == "req-2"
        log.info("block")
    assert current_request_id() is None
    lines = _lines(buf)
    assert [ln.get("request_id") for ln in lines] == ["req-1", "req-1", None, "req-2"]


async def test_request_id_is_per_task(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    log = get_logger("t")

    async def handle(rid: str) -> None:
        bind_request_id(rid)
        await asyncio.sleep(0)
        log.info("step", who=rid)
        await asyncio.sleep(0)
        log.info("step", who=rid)

    await asyncio.gather(*(handle(f"r{i}") for i in range(4)))
    lines = _lines(buf)
    assert len(lines) == 8
    assert all(ln["request_id"] == ln["who"] for ln in lines)
    assert current_request_id() is None  # the tasks' bindings never leak out


def test_exception_is_rendered(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("json", "info", stream=buf)
    try:
        raise RuntimeError("kaput")
    except RuntimeError:
        get_logger("t").exception("failed")
    (line,) = _lines(buf)
    assert "RuntimeError: kaput" in line["exception"]


def test_console_format_and_reconfigure(restore_logging: None) -> None:
    buf = io.StringIO()
    configure_logging("console", "debug", service="toy", stream=buf)
    get_logger("t").debug("for humans", x=1)
    text = buf.getvalue()
    assert "for humans" in text and "x=1" in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text.splitlines()[0])
    # A second call replaces the handler rather than adding one.
    buf2 = io.StringIO()
    configure_logging("json", "info", stream=buf2)
    get_logger("t").info("once")
    assert len(_lines(buf2)) == 1
    assert "once" not in buf.getvalue()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        configure_logging("xml")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        configure_logging("json", "chatty")
