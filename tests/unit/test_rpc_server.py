"""ServiceRunner + interceptors against a real grpc.aio server on 127.0.0.1 (port 0).

The toy service uses raw-bytes generic handlers (no serializers), so every call kind can be
exercised without proto messages; a fake Router servicer checks generated registration.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry

from pdserve.config import ServiceSettings
from pdserve.errors import (
    InvalidRequestError,
    ModelLoadError,
    NoInstanceHereError,
    OverloadedError,
    UnavailableError,
)
from pdserve.logging import configure_logging, current_request_id, get_logger
from pdserve.rpc import Metrics, ServiceApp, ServiceRunner, metadata_with_request_id
from pdserve.rpc.interceptor import status_for
from pdserve.rpc.ready import parse_ready_line
from pdserve.v1 import router_pb2, router_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
log = get_logger("toy")


class Toy(ServiceApp):
    name = "toy"
    health_service_names = ("toy.Toy",)

    def __init__(self) -> None:
        self.release_start = asyncio.Event()
        self.release_start.set()
        self.start_entered = asyncio.Event()
        self.drain_entered = asyncio.Event()
        self.release_drain = asyncio.Event()
        self.release_drain.set()
        self.stream_closed = asyncio.Event()
        self.cancelled = False
        self.closed = 0

    async def start(self, server: aio.Server) -> None:
        handlers = {
            "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
            "Count": grpc.unary_stream_rpc_method_handler(self.count),
            "Write": grpc.unary_stream_rpc_method_handler(self.write),
            "Sum": grpc.stream_unary_rpc_method_handler(self.sum),
        }
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("toy.Toy", handlers),)
        )
        self.start_entered.set()
        await self.release_start.wait()

    async def drain(self) -> None:
        self.drain_entered.set()
        await self.release_drain.wait()

    async def close(self) -> None:
        self.closed += 1

    async def echo(self, req: bytes, context: aio.ServicerContext) -> bytes:
        log.info("echo called")
        if req == b"bad":
            raise InvalidRequestError("max_tokens", "must be >= 1")
        if req == b"busy":
            raise OverloadedError("queue full")
        if req == b"crash":
            raise KeyError("secret")
        if req == b"abort":
            await context.abort(grpc.StatusCode.NOT_FOUND, "aborted by servicer")
        if req == b"no-instance":
            raise NoInstanceHereError("no instance took the stream over")
        if req == b"gone":
            raise UnavailableError("peer gone")
        if req == b"rid":
            return (current_request_id() or "none").encode()
        if req == b"upstream":  # a downstream call to a dead peer
            async with aio.insecure_channel("127.0.0.1:1") as ch:
                await ch.unary_unary("/x.X/Y")(b"", timeout=10)
        return req

    async def count(self, req: bytes, context: aio.ServicerContext) -> AsyncIterator[bytes]:
        log.info("count called")
        try:
            for i in range(1_000_000 if req == b"forever" else 3):
                if req == b"mid" and i == 2:
                    raise OverloadedError("full after two")
                if req == b"crash-mid" and i == 1:
                    raise ValueError("broken")
                yield (current_request_id() or str(i)).encode()
                await asyncio.sleep(0.01 if req == b"forever" else 0)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.stream_closed.set()

    async def write(self, req: bytes, context: aio.ServicerContext) -> None:
        await context.write(b"a")
        await context.write(b"b")
        raise UnavailableError("peer gone")

    async def sum(self, requests: AsyncIterator[bytes], context: aio.ServicerContext) -> bytes:
        total = 0
        async for chunk in requests:
            if chunk == b"x":
                raise InvalidRequestError("chunk", "not a digit")
            total += int(chunk)
        return str(total).encode()


def _settings(**kw: Any) -> ServiceSettings:
    return ServiceSettings(port=0, grace_s=0.0, drain_timeout_s=5.0, **kw)


@pytest.fixture
async def toy() -> AsyncIterator[tuple[Toy, ServiceRunner]]:
    app = Toy()
    runner = ServiceRunner(
        app, _settings(), metrics=Metrics(CollectorRegistry()), ready_stream=io.StringIO()
    )
    await runner.start()
    yield app, runner
    await runner.shutdown()


@pytest.fixture
def log_buffer(restore_logging: None) -> io.StringIO:
    buf = io.StringIO()
    configure_logging("json", "info", service="toy", stream=buf)
    return buf


async def _health(addr: str, service: str = "") -> int:
    async with aio.insecure_channel(addr) as ch:
        reply = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10
        )
    return reply.status


async def _call(addr: str, method: str, req: bytes, **kw: Any) -> bytes:
    async with aio.insecure_channel(addr) as ch:
        return await ch.unary_unary(f"/toy.Toy/{method}")(req, timeout=10, **kw)


async def _stream(addr: str, method: str, req: bytes, got: list[bytes], **kw: Any) -> None:
    async with aio.insecure_channel(addr) as ch:
        async for item in ch.unary_stream(f"/toy.Toy/{method}")(req, timeout=10, **kw):
            got.append(item)


async def test_health_not_serving_until_started_then_serving_then_draining() -> None:
    app = Toy()
    app.release_start.clear()
    ready = io.StringIO()
    runner = ServiceRunner(
        app, _settings(), metrics=Metrics(CollectorRegistry()), ready_stream=ready
    )
    starting = asyncio.ensure_future(runner.start())
    await asyncio.wait_for(app.start_entered.wait(), 30)  # listening, app loading
    assert runner.state == "starting"
    assert await _health(runner.address) == NOT_SERVING
    assert await _health(runner.address, "toy.Toy") == NOT_SERVING
    assert ready.getvalue() == ""  # not announced yet
    # a method not registered yet while the app starts: busy, not missing (retryable)
    with pytest.raises(aio.AioRpcError) as info:
        await _call(runner.address, "NotYet", b"too early")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and "starting" in info.value.details()
    got: list[bytes] = []
    with pytest.raises(aio.AioRpcError) as info:
        await _stream(runner.address, "NotYetStream", b"3", got)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE and got == []
    app.release_start.set()
    assert await starting == runner.port
    with pytest.raises(aio.AioRpcError) as info:  # started: an unknown method is missing
        await _call(runner.address, "NotYet", b"late")
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert await _health(runner.address) == SERVING
    assert await _health(runner.address, "toy.Toy") == SERVING
    info = parse_ready_line(ready.getvalue())
    assert info is not None and info["service"] == "toy" and info["port"] == runner.port

    app.release_drain.clear()
    stopping = asyncio.ensure_future(runner.shutdown())
    await asyncio.wait_for(app.drain_entered.wait(), 30)
    assert runner.state == "draining"
    assert await _health(runner.address) == NOT_SERVING  # still answering while draining
    assert await _call(runner.address, "Echo", b"in-flight ok") == b"in-flight ok"
    app.release_drain.set()
    await stopping
    assert runner.state == "stopped" and app.closed == 1
    await runner.shutdown()  # idempotent
    assert app.closed == 1


@pytest.mark.parametrize(
    ("req", "code", "details"),
    [
        (b"bad", grpc.StatusCode.INVALID_ARGUMENT, "max_tokens: must be >= 1"),
        (b"busy", grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"),
        (b"crash", grpc.StatusCode.INTERNAL, "KeyError: 'secret'"),
        (b"abort", grpc.StatusCode.NOT_FOUND, "aborted by servicer"),
        (b"upstream", grpc.StatusCode.UNAVAILABLE, "upstream UNAVAILABLE"),
    ],
)
async def test_unary_errors_map_to_status(
    toy: tuple[Toy, ServiceRunner], req: bytes, code: grpc.StatusCode, details: str
) -> None:
    _, runner = toy
    with pytest.raises(aio.AioRpcError) as info:
        await _call(runner.address, "Echo", req)
    assert info.value.code() == code
    assert details in (info.value.details() or "")


async def test_answered_mark_only_where_another_replica_cannot_do_better(
    toy: tuple[Toy, ServiceRunner],
) -> None:
    """An UNAVAILABLE the service decided carries the answered mark (the SDK gives up); one
    that says only that this router has no instance left is marked "elsewhere" (the SDK
    resumes the stream on a replica that has not said so)."""
    _, runner = toy
    marks = {}
    for req in (b"gone", b"no-instance"):
        with pytest.raises(aio.AioRpcError) as info:
            await _call(runner.address, "Echo", req)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        marks[req] = dict(info.value.trailing_metadata() or ()).get("pdserve-answered")
    assert marks == {b"gone": "1", b"no-instance": "elsewhere"}


async def test_streaming_errors_mid_stream(toy: tuple[Toy, ServiceRunner]) -> None:
    _, runner = toy
    got: list[bytes] = []
    await _stream(runner.address, "Count", b"ok", got)
    assert got == [b"0", b"1", b"2"]

    got = []
    with pytest.raises(aio.AioRpcError) as info:
        await _stream(runner.address, "Count", b"mid", got)
    assert got == [b"0", b"1"]  # items before the error arrived
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert info.value.details() == "full after two"

    got = []
    with pytest.raises(aio.AioRpcError) as info:
        await _stream(runner.address, "Count", b"crash-mid", got)
    assert got == [b"0"]
    assert info.value.code() == grpc.StatusCode.INTERNAL
    assert "ValueError: broken" in (info.value.details() or "")


async def test_write_style_stream_and_client_streaming_errors(
    toy: tuple[Toy, ServiceRunner],
) -> None:
    _, runner = toy
    got: list[bytes] = []
    with pytest.raises(aio.AioRpcError) as info:
        await _stream(runner.address, "Write", b"", got)
    assert got == [b"a", b"b"]
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert info.value.details() == "peer gone"

    async with aio.insecure_channel(runner.address) as ch:
        summed = ch.stream_unary("/toy.Toy/Sum")
        assert await summed(iter([b"1", b"2"]), timeout=10) == b"3"
        with pytest.raises(aio.AioRpcError) as info:
            await summed(iter([b"1", b"x"]), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_request_id_reaches_contextvar_and_logs(
    toy: tuple[Toy, ServiceRunner], log_buffer: io.StringIO
) -> None:
    _, runner = toy
    md = metadata_with_request_id("rid-42")
    assert await _call(runner.address, "Echo", b"rid", metadata=md) == b"rid-42"
    got: list[bytes] = []
    await _stream(runner.address, "Count", b"ok", got, metadata=metadata_with_request_id("rid-7"))
    assert got == [b"rid-7"] * 3
    assert await _call(runner.address, "Echo", b"rid") == b"none"
    with pytest.raises(aio.AioRpcError):
        await _call(runner.address, "Echo", b"crash", metadata=metadata_with_request_id("rid-9"))

    lines = [json.loads(ln) for ln in log_buffer.getvalue().splitlines() if ln.strip()]
    by_event: dict[str, list[dict]] = {}
    for line in lines:
        by_event.setdefault(line["event"], []).append(line)
    echo_ids = [ln.get("request_id") for ln in by_event["echo called"]]
    assert echo_ids == ["rid-42", None, "rid-9"]
    assert [ln.get("request_id") for ln in by_event["count called"]] == ["rid-7"]
    (crash,) = by_event["rpc crashed"]  # the interceptor's own line carries the id too
    assert crash["request_id"] == "rid-9" and "KeyError" in crash["exception"]
    assert current_request_id() is None


async def test_client_cancel_passes_through(toy: tuple[Toy, ServiceRunner]) -> None:
    app, runner = toy
    async with aio.insecure_channel(runner.address) as ch:
        call = ch.unary_stream("/toy.Toy/Count")(b"forever", timeout=30)
        await call.read()
        call.cancel()
        await asyncio.wait_for(app.stream_closed.wait(), 10)
    assert app.cancelled  # the servicer saw CancelledError, not a mapped error


async def test_metrics_count_method_and_code(toy: tuple[Toy, ServiceRunner]) -> None:
    _, runner = toy
    await _call(runner.address, "Echo", b"x")
    with pytest.raises(aio.AioRpcError):
        await _call(runner.address, "Echo", b"bad")
    with pytest.raises(aio.AioRpcError):
        await _stream(runner.address, "Count", b"mid", [])
    m = runner.metrics

    def count(method: str, code: str) -> float | None:
        return m.value("rpc_requests_total", {"method": f"/toy.Toy/{method}", "code": code})

    assert count("Echo", "OK") == 1
    assert count("Echo", "INVALID_ARGUMENT") == 1
    assert count("Count", "RESOURCE_EXHAUSTED") == 1
    assert m.value("rpc_latency_seconds_count", {"method": "/toy.Toy/Echo"}) == 2
    assert m.value("rpc_in_flight", {"method": "/toy.Toy/Echo"}) == 0


class FakeRouter(router_pb2_grpc.RouterServicer):
    async def Status(self, request: Any, context: Any) -> router_pb2.StatusResponse:
        return router_pb2.StatusResponse()

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        yield router_pb2.GenerateResponse(request_id=request.request_id, token_ids=[1, 2])
        raise InvalidRequestError("sampling.top_p", "must be in (0, 1]")


class RouterApp(ServiceApp):
    name = "router"
    health_service_names = ("pdserve.v1.Router",)

    async def start(self, server: aio.Server) -> None:
        router_pb2_grpc.add_RouterServicer_to_server(FakeRouter(), server)


async def test_generated_servicer_registered_in_start() -> None:
    runner = ServiceRunner(
        RouterApp(), _settings(), metrics=Metrics(CollectorRegistry()), ready_stream=io.StringIO()
    )
    async with runner:
        assert await _health(runner.address, "pdserve.v1.Router") == SERVING
        async with aio.insecure_channel(runner.address) as ch:
            stub = router_pb2_grpc.RouterStub(ch)
            await stub.Status(router_pb2.StatusRequest(), timeout=10)
            got = []
            with pytest.raises(aio.AioRpcError) as info:
                async for msg in stub.Generate(router_pb2.GenerateRequest(request_id="g1")):
                    got.append(list(msg.token_ids))
            assert got == [[1, 2]]
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(aio.AioRpcError) as info:
                await ch.unary_unary("/pdserve.v1.Router/Nope")(b"", timeout=10)
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


class BrokenApp(Toy):
    async def start(self, server: aio.Server) -> None:
        raise ModelLoadError("config.json: unsupported architecture")


async def test_failed_start_closes_app_and_raises() -> None:
    app = BrokenApp()
    runner = ServiceRunner(app, _settings(), metrics=Metrics(CollectorRegistry()))
    with pytest.raises(ModelLoadError):
        await runner.start()
    assert app.closed == 1 and runner.state == "stopped"


async def test_port_in_use_is_an_error(toy: tuple[Toy, ServiceRunner]) -> None:
    _, runner = toy
    other = ServiceRunner(
        Toy(),
        _settings().model_copy(update={"port": runner.port}),
        metrics=Metrics(CollectorRegistry()),
    )
    with pytest.raises(OSError, match="cannot listen"):
        await other.start()


def test_status_for_mapping() -> None:
    assert status_for(OverloadedError("x")) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "x")
    assert status_for(OverloadedError())[1] == "OverloadedError"
    code, details = status_for(RuntimeError("y" * 1000))
    assert code == grpc.StatusCode.INTERNAL and len(details) <= 300
    md = aio.Metadata()
    dead = aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, md, md, "connect failed")
    assert status_for(dead) == (grpc.StatusCode.UNAVAILABLE, "upstream UNAVAILABLE: connect failed")
    odd = aio.AioRpcError(grpc.StatusCode.INVALID_ARGUMENT, md, md, "bad")
    assert status_for(odd)[0] == grpc.StatusCode.INTERNAL


def test_ready_line_round_trip() -> None:
    from pdserve.rpc.ready import format_ready_line

    line = format_ready_line({"service": "x", "port": 5})
    assert line.startswith("PDSERVE_READY {")
    assert parse_ready_line(line + "\n") == {"service": "x", "port": 5}
    assert parse_ready_line("PDSERVE_READY not json") is None
    assert parse_ready_line('{"port": 5}') is None
