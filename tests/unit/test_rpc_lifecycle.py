"""Shutdown paths: SIGTERM in a real process, a signal during start, drain timeout, a second
stop request, a drain that fails. No timing assertions: only orders and outcomes."""

from __future__ import annotations

import asyncio
import io
import os
import signal
import sys
from pathlib import Path

import pytest
from grpc import aio
from prometheus_client import CollectorRegistry

from pdserve.config import ServiceSettings
from pdserve.rpc import Metrics, ServiceApp, ServiceRunner, check_health_async, parse_ready_line

SRC = Path(__file__).resolve().parents[2] / "src"

SCRIPT = r"""
import asyncio, sys
from pdserve.config import ServiceSettings, load_settings
from pdserve.rpc import ServiceApp, serve

def say(text):
    print(text, flush=True)

class App(ServiceApp):
    name = "sigtoy"
    health_service_names = ("sig.Toy",)

    async def start(self, server):
        say("STARTED")

    async def drain(self):
        say("DRAIN-BEGIN")
        await asyncio.sleep(0.05)
        say("DRAIN-END")

    async def close(self):
        say("CLOSED")

sys.exit(serve(App(), load_settings(ServiceSettings, sys.argv[1:])))
"""


async def _read_until_ready(stream: asyncio.StreamReader, seen: list[str]) -> dict:
    while True:
        raw = await stream.readline()
        if not raw:
            raise AssertionError(f"process exited before PDSERVE_READY; stdout: {seen}")
        line = raw.decode().strip()
        seen.append(line)
        info = parse_ready_line(line)
        if info is not None:
            return info


async def test_sigterm_drains_then_exits_zero() -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        SCRIPT,
        "--port",
        "0",
        "--grace-s",
        "1",
        "--log-format",
        "json",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        info = await asyncio.wait_for(_read_until_ready(proc.stdout, seen), 60)
        assert info["service"] == "sigtoy" and info["port"] > 0 and info["pid"] == proc.pid
        addr = f"127.0.0.1:{info['port']}"
        assert await check_health_async(addr, timeout=10)
        assert await check_health_async(addr, timeout=10, service="sig.Toy")
        proc.send_signal(signal.SIGTERM)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    lines = seen + out.decode().split()
    assert proc.returncode == 0, err.decode()[-2000:]
    assert lines.index("STARTED") < lines.index("DRAIN-BEGIN")
    assert lines.index("DRAIN-BEGIN") < lines.index("DRAIN-END") < lines.index("CLOSED")
    # Logs went to stderr (stdout stays machine-readable), as JSON lines.
    log_text = err.decode()
    assert '"event": "draining"' in log_text and '"event": "stopped"' in log_text
    assert not await check_health_async(addr, timeout=0.5)


class Hanging(ServiceApp):
    name = "hang"

    def __init__(self, hang_start: bool = False, hang_drain: bool = False) -> None:
        self.hang_start = hang_start
        self.hang_drain = hang_drain
        self.events: list[str] = []
        self.started = asyncio.Event()
        self.draining = asyncio.Event()

    async def start(self, server: aio.Server) -> None:
        self.started.set()
        if self.hang_start:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.events.append("start-cancelled")
                raise

    async def drain(self) -> None:
        self.events.append("drain")
        self.draining.set()
        if self.hang_drain:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.events.append("drain-cancelled")
                raise

    async def close(self) -> None:
        self.events.append("close")


def _runner(app: ServiceApp, **kw: float) -> ServiceRunner:
    settings = ServiceSettings(port=0, grace_s=0.0, **kw)
    return ServiceRunner(
        app, settings, metrics=Metrics(CollectorRegistry()), ready_stream=io.StringIO()
    )


async def test_stop_during_start_cancels_start_and_closes() -> None:
    app = Hanging(hang_start=True)
    runner = _runner(app)
    running = asyncio.ensure_future(runner.run(signals=()))
    await asyncio.wait_for(app.started.wait(), 30)
    runner.request_stop()
    await asyncio.wait_for(running, 30)
    assert app.events == ["start-cancelled", "close"]
    assert runner.state == "stopped"


async def test_drain_timeout_still_stops_and_closes() -> None:
    app = Hanging(hang_drain=True)
    runner = _runner(app, drain_timeout_s=0.05)
    await runner.start()
    await asyncio.wait_for(runner.shutdown(), 30)
    assert app.events == ["drain", "drain-cancelled", "close"]


async def test_second_stop_request_cuts_drain_short() -> None:
    app = Hanging(hang_drain=True)
    runner = _runner(app, drain_timeout_s=3600)
    running = asyncio.ensure_future(runner.run(signals=()))
    await asyncio.wait_for(runner.serving.wait(), 30)
    runner.request_stop()
    await asyncio.wait_for(app.draining.wait(), 30)
    runner.request_stop()
    await asyncio.wait_for(running, 30)
    assert app.events == ["drain", "drain-cancelled", "close"]


async def test_real_signal_in_process() -> None:
    app = Hanging()
    runner = _runner(app)
    running = asyncio.ensure_future(runner.run(signals=(signal.SIGUSR1,)))
    await asyncio.wait_for(runner.serving.wait(), 30)
    os.kill(os.getpid(), signal.SIGUSR1)
    await asyncio.wait_for(running, 30)
    assert app.events == ["drain", "close"]
    # The handler is removed afterwards: the default action is restored on the loop.
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, signal.default_int_handler)


class FailingDrain(Hanging):
    async def drain(self) -> None:
        self.events.append("drain")
        raise RuntimeError("drain broke")


async def test_failed_drain_still_closes() -> None:
    app = FailingDrain()
    runner = _runner(app)
    await runner.start()
    await runner.shutdown()
    assert app.events == ["drain", "close"] and runner.state == "stopped"


async def test_start_twice_is_an_error() -> None:
    runner = _runner(Hanging())
    await runner.start()
    try:
        with pytest.raises(RuntimeError, match="already"):
            await runner.start()
    finally:
        await runner.shutdown()


async def test_signal_burst_does_not_cut_drain() -> None:
    app = Hanging(hang_drain=True)
    runner = _runner(app, drain_timeout_s=3600)
    running = asyncio.ensure_future(runner.run(signals=()))
    await asyncio.wait_for(runner.serving.wait(), 30)
    runner._on_signal(signal.SIGTERM)
    await asyncio.wait_for(app.draining.wait(), 30)
    runner._on_signal(signal.SIGTERM)  # the same kill delivered twice: ignored
    await asyncio.sleep(0)
    assert not running.done() and "drain-cancelled" not in app.events
    runner.request_stop()  # an explicit second request does cut it short
    await asyncio.wait_for(running, 30)
    assert app.events == ["drain", "drain-cancelled", "close"]


class Registering(Hanging):
    def __init__(self, fail: bool = False) -> None:
        super().__init__()
        self.fail = fail
        self.ports: list[int] = []

    async def on_serving(self, port: int) -> None:
        self.events.append("on_serving")
        self.ports.append(port)
        if self.fail:
            raise ConnectionError("router unreachable")


async def test_on_serving_gets_bound_port_before_ready() -> None:
    app = Registering()
    ready = io.StringIO()
    settings = ServiceSettings(port=0, grace_s=0.0)
    runner = ServiceRunner(app, settings, metrics=Metrics(CollectorRegistry()), ready_stream=ready)
    async with runner:
        assert app.ports == [runner.port] and runner.port
        info = parse_ready_line(ready.getvalue())
        assert info is not None and info["port"] == runner.port
        assert await check_health_async(runner.address, timeout=10)
    assert app.events == ["on_serving", "drain", "close"]


async def test_failing_on_serving_aborts_start() -> None:
    app = Registering(fail=True)
    ready = io.StringIO()
    settings = ServiceSettings(port=0, grace_s=0.0)
    runner = ServiceRunner(app, settings, metrics=Metrics(CollectorRegistry()), ready_stream=ready)
    with pytest.raises(ConnectionError):
        await runner.start()
    assert app.events == ["on_serving", "close"]
    assert ready.getvalue() == "" and runner.state == "stopped"
