"""The worker process: a ServiceApp that loads the engine, serves the Worker API and keeps
itself registered with every router replica."""

from __future__ import annotations

import prometheus_client
from grpc import aio

from pdserve.logging import get_logger
from pdserve.rpc.advertise import advertised_address
from pdserve.rpc.server import ServiceApp
from pdserve.v1 import worker_pb2_grpc
from pdserve.worker.core import WorkerCore
from pdserve.worker.metrics import WorkerCollector
from pdserve.worker.registration import Registration
from pdserve.worker.servicer import WorkerServicer
from pdserve.worker.settings import WorkerSettings

_log = get_logger(__name__)


class WorkerApp(ServiceApp):
    health_service_names = ("pdserve.v1.Worker",)
    tls_name = "worker"

    def __init__(self, settings: WorkerSettings) -> None:
        self.name = f"worker-{settings.role}"
        self.settings = settings
        self.core = WorkerCore(settings)
        self.registration: Registration | None = None
        self._collector: WorkerCollector | None = None

    async def start(self, server: aio.Server) -> None:
        await self.core.load()
        if self.settings.kvstore_addr:
            self.core.attach_kvstore(self.settings.kvstore_addr)
        worker_pb2_grpc.add_WorkerServicer_to_server(WorkerServicer(self.core), server)
        self._collector = WorkerCollector(self.core)
        prometheus_client.REGISTRY.register(self._collector)

    async def on_serving(self, port: int) -> None:
        """Register only once health says SERVING, with the port actually bound."""
        if not self.settings.router_addr:
            return
        self.registration = Registration(
            self.core,
            self.settings.router_addr,
            advertised_address(self.settings.host, port, self.settings.advertise_host),
            on_kvstore=None if self.settings.kvstore_addr else self.core.attach_kvstore,
            discovery=self.settings.router_discovery,
            resolve_s=self.settings.router_resolve_s,
        )
        self.registration.start()

    async def drain(self) -> None:
        await self.core.drain()

    async def close(self) -> None:
        if self._collector is not None:
            prometheus_client.REGISTRY.unregister(self._collector)
            self._collector = None
        if self.registration is not None:
            await self.registration.stop()
        await self.core.close()
