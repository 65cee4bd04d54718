"""`pdserve chat` in a real pseudo-terminal against an in-process fake Router: /commands never
reach the model; Ctrl-C during a reply cancels the request on the server and keeps the
session (the cancelled turn is not in the history); Ctrl-C twice, or Ctrl-D, exits with 0."""

from __future__ import annotations

import asyncio
import os
import pty
import select
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

START_TIMEOUT_S = 90.0

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(sys.platform != "linux", reason="pty test (Linux)"),
]


class SlowRouter(router_pb2_grpc.RouterServicer):
    """Streams "w0 w1 ..." one word per 50 ms: forever for a prompt containing "forever",
    else 3 words."""

    def __init__(self) -> None:
        self.requests: list[router_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        forever = "forever" in request.chat.messages[-1].content
        n = 10_000 if forever else 3
        try:
            for i in range(n):
                await asyncio.sleep(0.05)
                last = i == n - 1
                resp = router_pb2.GenerateResponse(
                    token_ids=[i],
                    text=f"w{i} ",
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                )
                if last:
                    resp.usage.CopyFrom(
                        router_pb2.Usage(prompt_tokens=20, completion_tokens=n, cached_tokens=16)
                    )
                yield resp
        except asyncio.CancelledError:
            self.cancelled.set()
            raise

    async def Status(self, request, context):
        return router_pb2.StatusResponse(model="fake-model")


@pytest.fixture
def router():
    servicer = SlowRouter()
    ready = threading.Event()
    state: dict = {}

    def serve() -> None:
        async def main() -> None:
            server = grpc.aio.server()
            router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
            state["port"] = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            state["stop"] = asyncio.Event()
            ready.set()
            await state["stop"].wait()
            await server.stop(0)

        loop = asyncio.new_event_loop()
        state["loop"] = loop
        loop.run_until_complete(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(10)
    servicer.addr = f"127.0.0.1:{state['port']}"
    yield servicer
    state["loop"].call_soon_threadsafe(state["stop"].set)
    t.join(10)


class Term:
    def __init__(self, argv: list[str]) -> None:
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the pty is its controlling terminal
            os.execv(sys.executable, [sys.executable, *argv])
        self.buf = b""

    def expect(self, text: str, timeout: float = 20.0) -> str:
        deadline = time.monotonic() + timeout
        while text.encode() not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"{text!r} not seen; child {self.state()}; output so far:\n{self.buf.decode()}"
                )
            r, _, _ = select.select([self.fd], [], [], left)
            if r:
                try:
                    self.buf += os.read(self.fd, 4096)
                except OSError:  # the child exited
                    break
        if text.encode() not in self.buf:
            raise AssertionError(f"{text!r} not seen; output:\n{self.buf.decode()}")
        i = self.buf.index(text.encode()) + len(text)
        seen, self.buf = self.buf[:i].decode(), self.buf[i:]
        return seen

    def state(self) -> str:
        """What the child is doing (for a failure message): its command line and state."""
        try:
            cmd = Path(f"/proc/{self.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            status = Path(f"/proc/{self.pid}/status").read_text().splitlines()
            st = next((line for line in status if line.startswith("State:")), "")
            wchan = Path(f"/proc/{self.pid}/wchan").read_text()
            return f"{cmd.strip()!r} {st} wchan={wchan}"
        except OSError:
            return "gone"

    def started(self) -> None:
        """The banner: a hang guard sized for a heavily loaded machine (start-up runs the
        imports and a Status call; on 2 shared cores with a CPU hog it took > 20 s once)."""
        self.expect("/help for commands", timeout=START_TIMEOUT_S)

    def send(self, data: str) -> None:
        os.write(self.fd, data.encode())

    def wait(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with_status = os.waitpid(self.pid, os.WNOHANG)
            if with_status[0]:
                return os.waitstatus_to_exitcode(with_status[1])
            try:  # keep draining, so the child never blocks on a full pty
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.buf += os.read(self.fd, 4096)
            except OSError:
                pass
        os.kill(self.pid, 9)
        raise AssertionError(f"chat did not exit; output:\n{self.buf.decode()}")


def chat(router) -> Term:
    return Term(["-m", "pdserve.cli.main", "chat", "--addr", router.addr])


def test_ctrl_c_cancels_the_reply_and_keeps_the_session(router):
    t = chat(router)
    t.started()
    t.expect("> ")
    t.send("/help\n")
    t.expect("/stats")
    t.send("/nonsense\n")
    t.expect("unknown command /nonsense")
    assert router.requests == []  # commands never reach the model
    t.send("tell me forever\n")
    t.expect("w2 ")
    t.send("\x03")  # Ctrl-C while the reply streams
    t.expect("reply cancelled")
    assert router.cancelled.wait(10), "the router never saw the cancellation"
    t.send("short one\n")
    t.expect("w2 \r\n")
    last = router.requests[-1].chat.messages
    assert [m.content for m in last] == ["short one"]  # the cancelled turn is not kept
    assert router.requests[-1].session_id == router.requests[0].session_id
    t.send("/stats\n")
    seen = t.expect("turn  prompt  cached")
    t.expect("16")
    assert "Traceback" not in seen
    t.send("//slash\n")
    t.expect("w2 ")
    assert router.requests[-1].chat.messages[-1].content == "/slash"
    t.expect("> ")  # the reply is over: this Ctrl-C is at the prompt
    t.send("\x03")
    t.expect("Ctrl-C again")
    t.send("\x03")
    assert t.wait() == 0
    assert "Traceback" not in t.buf.decode()


def test_ctrl_d_exits_cleanly(router):
    t = chat(router)
    t.started()
    t.expect("> ")
    t.send("\x04")
    assert t.wait() == 0
