"""One server lifecycle for every service.

    start:    TLS material from settings (pdserve.rpc.tls; none and not --insecure: refuse)
              -> grpc.aio server(s): an app with `public_services` gets a public server on
              `port` (those services only) and an internal one on `internal_port`; any other
              app one internal server on `port`. Internal servers use mutual TLS and the
              authorization table (pdserve.rpc.authz). Interceptors: undecodable bodies,
              request id, [authz | public extras], metrics, errors
              + grpc.health.v1 Health on every server, every name NOT_SERVING
              -> await app.start(server)   (add servicers, load the model, ...)
              -> SERVING -> await app.on_serving(port) (e.g. register with the router)
              -> one line `PDSERVE_READY {"service": ..., "port": N, ...}` on stdout
    SIGTERM / SIGINT:
              health NOT_SERVING -> await app.drain() (at most drain_timeout_s; a second signal
              cuts it short) -> server.stop(grace_s) -> await app.close()

A signal during app.start() cancels the start and closes the app. A second signal (at least
1 s after the first) cuts the drain short. Logs go to stderr, so
stdout carries only the READY line (the launcher and the tests wait for it).
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import IO, Any, cast

from grpc import aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve.config import ServiceSettings
from pdserve.logging import configure_logging, get_logger
from pdserve.rpc.authz import AuthzInterceptor
from pdserve.rpc.channels import SERVER_OPTIONS
from pdserve.rpc.interceptor import server_interceptors
from pdserve.rpc.metrics import Metrics, MetricsInterceptor, start_metrics_server
from pdserve.rpc.ready import format_ready_line
from pdserve.rpc.registration import AppServer, LateHandlers, PlaneHandlers
from pdserve.rpc.tls import (
    TlsConfigError,
    TlsFiles,
    configure_client,
    files_from_settings,
    log_insecure,
)

HEALTH_SERVICE = "grpc.health.v1.Health"
SIGNAL_REPEAT_S = 1.0
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

_log = get_logger(__name__)


class ServiceApp(abc.ABC):
    """What a service plugs into the runner.

    Contract: `start` registers servicers on `server` (generated `add_*_to_server` works; the
    server is already listening, health says NOT_SERVING until start returns) and does any
    slow loading; raising aborts the process start. `on_serving(port)` runs once health
    says SERVING, before the READY line (the bound port is known then: register with the
    router here); raising aborts the start too. `drain` stops accepting new work and
    waits for in-flight work (it is cancelled after drain_timeout_s). `close` releases
    everything; it runs once, after the gRPC server has stopped, also after a failed start.
    """

    name: str = "service"
    # Fully-qualified gRPC service names reported by the health service ("" is always added).
    health_service_names: Sequence[str] = ()

    # Two planes. Services named here are served on the public port (settings.port) only,
    # without client certificates; every other service of the app is served on the internal
    # listener (settings.internal_port) with mutual TLS and the authorization table
    # (pdserve.rpc.authz). An app with no public services has one, internal, listener on
    # settings.port. Health is served on both.
    public_services: Sequence[str] = ()
    # Which certificate of a --tls-dir this service uses by default (--tls-name overrides).
    tls_name: str = "service"

    def public_interceptors(self) -> Sequence[aio.ServerInterceptor]:
        """Extra interceptors of the public server (e.g. API keys), outermost first, inside
        the request-id interceptor and outside metrics and errors. Default: none."""
        return ()

    def public_server_options(self) -> Sequence[tuple[str, Any]]:
        """grpc options of the public server (e.g. a smaller max message size)."""
        return SERVER_OPTIONS

    @abc.abstractmethod
    async def start(self, server: aio.Server) -> None: ...

    async def on_serving(self, port: int) -> None:  # noqa: B027 (optional hook)
        """Called once health says SERVING, with the bound port (e.g. to register with a
        router). Default: nothing."""

    def ready_info(self) -> dict[str, Any]:
        """Extra fields for the READY line (e.g. a second port the app listens on)."""
        return {}

    async def drain(self) -> None:  # noqa: B027 (optional hook)
        """Default: nothing to wait for."""

    async def close(self) -> None:  # noqa: B027 (optional hook)
        """Default: nothing to release."""


def _address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # IPv6 literal
    return f"{host}:{port}"


class ServiceRunner:
    """Runs one ServiceApp; usable directly in tests (start / shutdown) or via run()."""

    def __init__(
        self,
        app: ServiceApp,
        settings: ServiceSettings,
        *,
        metrics: Metrics | None = None,
        ready_stream: IO[str] | None = None,
    ) -> None:
        self.app = app
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.port: int | None = None
        self.state = "new"  # new -> starting -> serving -> draining -> stopped
        self.health = health.aio.HealthServicer()
        self.server: aio.Server | None = None  # the server on settings.port
        self.servers: list[aio.Server] = []
        self.internal_port: int | None = None
        self._ready_stream = ready_stream
        self.serving = asyncio.Event()  # set once SERVING (and the READY line is out)
        self._stop_requested = asyncio.Event()
        self._force = asyncio.Event()
        self._first_signal_at: float | None = None
        self._shutdown_task: asyncio.Future[None] | None = None
        self._log = _log.bind(service=app.name)

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return _address(self.settings.host, self.port)

    @property
    def health_names(self) -> list[str]:
        return ["", *self.app.health_service_names]

    async def start(self) -> int:
        """Listen, start the app, go SERVING, print the READY line. Returns the bound port
        (the public port of an app with a public plane, else its one internal port)."""
        if self.state != "new":
            raise RuntimeError(f"runner already {self.state}")
        self.state = "starting"
        try:
            tls_files = files_from_settings(self.settings, self.app.tls_name)
        except TlsConfigError as exc:
            self.state = "stopped"
            raise OSError(f"{self.app.name}: {exc}") from exc
        if tls_files is None:
            log_insecure()
        configure_client(tls_files)
        late = LateHandlers()
        public = tuple(self.app.public_services)
        if public:
            pub = self._server(
                late, lambda svc: svc in public, self.app.public_interceptors(),
                self.app.public_server_options(),
            )  # fmt: skip
            port = self._listen(pub, self.settings.port, None)
            internal_port_setting = int(getattr(self.settings, "internal_port", 0) or 0)
            internal = self._server(late, lambda svc: svc not in public, self._authz(tls_files))
            self.internal_port = self._listen(internal, internal_port_setting, tls_files)
            self.servers = [pub, internal]
        else:
            internal = self._server(late, lambda svc: True, self._authz(tls_files))
            port = self.internal_port = self._listen(internal, self.settings.port, tls_files)
            self.servers = [internal]
        self.server = self.servers[0]
        self.port = port
        for name in self.health_names:
            await self.health.set(name, _NOT_SERVING)
        for server in self.servers:
            await server.start()
        self._log.info(
            "listening", host=self.settings.host, port=port, internal_port=self.internal_port,
            tls=tls_files is not None,
        )  # fmt: skip
        try:
            await self.app.start(cast(aio.Server, AppServer(self.server, late)))
            late.ready = True  # from now on an unknown method is UNIMPLEMENTED
        except BaseException as exc:  # incl. CancelledError (signal during start)
            self._log.error("start failed", error=repr(exc), exc_info=exc)
            await self._stop_server_and_close(grace=0)
            raise
        for name in self.health_names:
            await self.health.set(name, _SERVING)
        try:
            await self.app.on_serving(port)  # e.g. register with the router
        except BaseException as exc:
            self._log.error("on_serving failed", error=repr(exc), exc_info=exc)
            await self.health.enter_graceful_shutdown()
            await self._stop_server_and_close(grace=0)
            raise
        self.state = "serving"
        self._announce()
        self.serving.set()
        return port

    def _authz(self, tls_files: TlsFiles | None) -> Sequence[aio.ServerInterceptor]:
        return (AuthzInterceptor(),) if tls_files is not None else ()

    def _server(
        self,
        late: LateHandlers,
        serves: Callable[[str], bool],
        extra: Sequence[aio.ServerInterceptor],
        options: Sequence[tuple[str, Any]] = SERVER_OPTIONS,
    ) -> aio.Server:
        """One grpc server of one plane: `serves(service_name)` says which of the app's
        services it exposes (health is on every server)."""
        interceptors = server_interceptors(*extra, MetricsInterceptor(self.metrics))
        server = aio.server(interceptors=interceptors, options=list(options))
        server.add_generic_rpc_handlers((PlaneHandlers(late, serves),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        return server

    def _listen(self, server: aio.Server, port: int, tls_files: TlsFiles | None) -> int:
        requested = _address(self.settings.host, port)
        try:
            if tls_files is None:
                bound = server.add_insecure_port(requested)
            else:
                bound = server.add_secure_port(requested, tls_files.server_credentials())
        except RuntimeError as exc:
            bound, cause = 0, exc
        else:
            cause = None
        if not bound:
            self.state = "stopped"
            raise OSError(f"{self.app.name}: cannot listen on {requested} (in use?)") from cause
        return bound

    def _announce(self) -> None:
        info: dict[str, Any] = {
            "service": self.app.name,
            "host": self.settings.host,
            "port": self.port,
            "internal_port": self.internal_port,
            "pid": os.getpid(),
            "instance_id": self.settings.instance_id,
        }
        info.update(self.app.ready_info())
        self._log.info("serving", **info)
        out = self._ready_stream if self._ready_stream is not None else sys.stdout
        out.write(format_ready_line(info) + "\n")
        out.flush()

    def request_stop(self) -> None:
        """Ask run() to shut down (signal handlers call this). A second call skips the rest
        of the drain."""
        if self._stop_requested.is_set():
            if not self._force.is_set():
                self._log.warning("second stop request: cutting the drain short")
            self._force.set()
        self._stop_requested.set()

    async def shutdown(self) -> None:
        """NOT_SERVING -> drain -> stop(grace) -> close. Idempotent; concurrent callers all
        wait for the one shutdown."""
        if self._shutdown_task is None:
            self._shutdown_task = asyncio.ensure_future(self._shutdown())
        await asyncio.shield(self._shutdown_task)

    async def _shutdown(self) -> None:
        if self.state != "serving":
            return
        self.state = "draining"
        self._log.info("draining", timeout_s=self.settings.drain_timeout_s)
        await self.health.enter_graceful_shutdown()
        await self._drain()
        await self._stop_server_and_close(grace=self.settings.grace_s)
        self._log.info("stopped")

    async def _drain(self) -> None:
        drain = asyncio.ensure_future(self.app.drain())
        force = asyncio.ensure_future(self._force.wait())
        done, _ = await asyncio.wait(
            {drain, force},
            timeout=self.settings.drain_timeout_s,
            return_when=asyncio.FIRST_COMPLETED,
        )
        for task in (drain, force):
            task.cancel()
        await asyncio.gather(drain, force, return_exceptions=True)
        if drain in done and not drain.cancelled() and drain.exception() is not None:
            self._log.error("drain failed", exc_info=drain.exception())
        elif drain not in done:
            self._log.warning("drain cut short", forced=force in done)

    async def _stop_server_and_close(self, grace: float) -> None:
        if self.servers:
            await asyncio.gather(*(server.stop(grace) for server in self.servers))
        try:
            await self.app.close()
        except Exception:
            self._log.exception("close failed")
        self.state = "stopped"

    async def run(
        self, signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGINT)
    ) -> None:
        """start(), serve until a signal (or request_stop()), then shutdown()."""
        loop = asyncio.get_running_loop()
        installed = []
        for sig in signals:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.add_signal_handler(sig, self._on_signal, sig)
                installed.append(sig)
        starting = asyncio.ensure_future(self.start())
        stopping = asyncio.ensure_future(self._stop_requested.wait())
        try:
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():  # stop requested while the app was starting
                starting.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await starting
                return
            starting.result()  # re-raises a failed start
            await stopping
            await self.shutdown()
        finally:
            for task in (starting, stopping):
                task.cancel()
            for sig in installed:
                loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        now = asyncio.get_running_loop().time()
        # One kill often arrives twice (to the process and to its group, e.g. from
        # `timeout`); only a repeat at least SIGNAL_REPEAT_S later cuts the drain short.
        if self._first_signal_at is not None and now - self._first_signal_at < SIGNAL_REPEAT_S:
            self._log.info("signal repeated, ignored", signal=sig.name)
            return
        self._log.info("signal received", signal=sig.name)
        if self._first_signal_at is None:
            self._first_signal_at = now
        self.request_stop()

    async def __aenter__(self) -> ServiceRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()


async def run_service(
    app: ServiceApp,
    settings: ServiceSettings,
    *,
    metrics: Metrics | None = None,
    configure_logs: bool = True,
) -> None:
    """The whole life of a service process: logging, /metrics, run() until SIGTERM/SIGINT.
    Returns after a clean shutdown (exit status 0); raises if the app failed to start."""
    if configure_logs:
        configure_logging(
            settings.log_format, settings.log_level, app.name, instance_id=settings.instance_id
        )
    metrics = metrics if metrics is not None else Metrics()
    metrics_server = start_metrics_server(settings.metrics_port, metrics.registry, settings.host)
    try:
        await ServiceRunner(app, settings, metrics=metrics).run()
    finally:
        if metrics_server is not None:
            metrics_server.close()


def install_event_loop() -> bool:
    """Use uvloop for new event loops when it is installed; True if it is."""
    try:
        import uvloop
    except ImportError:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def serve(app: ServiceApp, settings: ServiceSettings) -> int:
    """Blocking entry point for a service's __main__: uvloop if present, run_service, and
    the exit status (0 after a clean shutdown, 1 if the service failed to start)."""
    from pdserve.rpc.parent import die_with_parent

    die_with_parent()  # started by `pdserve up`: exit with it
    install_event_loop()
    try:
        asyncio.run(run_service(app, settings))
    except Exception as exc:
        _log.error("service failed", service=app.name, error=repr(exc), exc_info=exc)
        return 1
    return 0
