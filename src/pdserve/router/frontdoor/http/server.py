"""uvicorn serving the OpenAI app on the router's own event loop (no thread, no second
process): requests reach FrontDoor, the orchestrator and the registry directly, with no
hop and no locking. uvicorn's signal capture is disabled: the router's lifecycle
(pdserve.rpc.server) owns SIGTERM/SIGINT and stops this server after its drain."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator

import uvicorn

from pdserve.logging import get_logger

log = get_logger("pdserve.router.frontdoor.http")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # the router handles signals
        yield


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"HTTP API: cannot listen on {host}:{port} ({exc.strerror})") from exc
    sock.setblocking(False)
    return sock


class HttpServer:
    def __init__(self, app, host: str, port: int, grace_s: float = 5.0) -> None:
        self._sock = _bind(host, port)
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=False,
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=max(1, int(grace_s)),
            server_header=False,
        )
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._server.serve(sockets=[self._sock]))
        while not self._server.started:
            if self._task.done():  # failed to start: surface the error
                self._task.result()
                raise RuntimeError("HTTP server stopped during start")
            await asyncio.sleep(0.01)
        log.info("http listening", host=self.host, port=self.port)

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._sock.close()
