"""The sync Client survives a Ctrl-C at ANY bytecode of the calling thread: the stream's call is
always cancelled, nothing stays running, and the caller sees KeyboardInterrupt (before the fix,
an interrupt between submitting `__anext__` and waiting for it made the generator's cleanup
raise "aclose(): asynchronous generator is already running" and the chat died).

The interrupt is injected deterministically: a trace function raises KeyboardInterrupt at the
k-th opcode executed in pdserve/client/sync.py, for every k until the stream completes
without reaching k. An async-generator fake stands in for the router (no process, no network)."""

from __future__ import annotations

import asyncio
import sys
import time
from contextlib import closing

import pytest

from pdserve.client import sync as sync_mod
from pdserve.client.results import GenerationEvent
from pdserve.client.sync import Client, _Call

EVENTS = 2


class FakeAio:
    """AsyncClient.generate_stream's shape: events until cancelled; counts open streams."""

    def __init__(self) -> None:
        self.started = self.open = 0

    async def generate_stream(self, timeout=None, **kwargs):
        self.started += 1
        self.open += 1
        try:
            for i in range(EVENTS):
                await asyncio.sleep(0)
                yield GenerationEvent("r", [i], "x", 0.0)
        finally:
            self.open -= 1

    async def close(self) -> None:
        pass


@pytest.fixture
def client():
    c = Client("127.0.0.1:1")  # never connects: the fake below replaces the channel's client
    c._run(c._aclient.close())
    c._aclient = FakeAio()
    yield c
    c.close()


class RaiseAt:
    """A trace function: KeyboardInterrupt at the k-th opcode run in sync.py frames."""

    def __init__(self, k: int) -> None:
        self.k, self.seen, self.fired = k, 0, False

    def __call__(self, frame, event, arg):
        if frame.f_code.co_filename != sync_mod.__file__:
            return None
        frame.f_trace_opcodes = True
        return self._local

    def _local(self, frame, event, arg):
        if event == "opcode":
            self.seen += 1
            if self.seen == self.k:
                self.fired = True
                raise KeyboardInterrupt
        return self._local


def _settled(fake: FakeAio, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while fake.open and time.monotonic() < deadline:
        time.sleep(0.001)
    return fake.open == 0


def test_an_interrupt_anywhere_cancels_the_stream(client):
    fake = client._aclient
    k = 0
    while True:
        k += 1
        tracer = RaiseAt(k)
        got: list[int] = []
        try:
            sys.settrace(tracer)
            with closing(client.generate_stream(prompt="x")) as events:
                got = [t for ev in events for t in ev.token_ids]
        except KeyboardInterrupt:
            assert tracer.fired
        finally:
            sys.settrace(None)
        assert _settled(fake), f"interrupt at opcode {k}: the stream is still running"
        if not tracer.fired:  # ran to the end before the k-th opcode: every point was tried
            assert got == list(range(EVENTS))
            break
    assert k > 20, "the trace never reached sync.py"


def test_a_cancel_that_overtakes_the_start_never_runs_the_coroutine(client):
    ran: list[bool] = []

    async def body() -> int:
        ran.append(True)
        return 1

    call = _Call(client._loop, body)
    call.cancel()  # issued first: the loop runs it first
    call.start()
    assert call.wait(5.0)
    with pytest.raises(Exception) as err:
        call.result()
    assert type(err.value).__name__ == "CancelledError" and ran == [] and not call.started


def test_leaving_a_stream_early_cancels_it_before_close_returns(client):
    fake = client._aclient
    stream = client.generate_stream(prompt="x")
    assert next(stream).token_ids == [0]
    stream.close()
    assert fake.open == 0  # not "eventually": close() waited for the call to stop
