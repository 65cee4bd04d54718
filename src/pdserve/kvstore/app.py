"""KVStoreApp: the kvstore on the shared service lifecycle (pdserve.rpc.server)."""

from __future__ import annotations

from grpc import aio

from pdserve.kv.transfer import UcxTransport
from pdserve.kvstore.metrics import KVStoreMetrics
from pdserve.kvstore.service import KVStoreService
from pdserve.kvstore.servicer import KVStoreServicer
from pdserve.kvstore.settings import KVStoreSettings
from pdserve.logging import get_logger
from pdserve.rpc.metrics import Metrics
from pdserve.rpc.server import ServiceApp
from pdserve.v1 import kvstore_pb2_grpc

log = get_logger("pdserve.kvstore")


class KVStoreApp(ServiceApp):
    name = "kvstore"
    health_service_names = ("pdserve.v1.KVStore",)
    tls_name = "kvstore"

    def __init__(self, settings: KVStoreSettings, metrics: Metrics | None = None) -> None:
        self.settings = settings
        self.metrics = metrics if metrics is not None else Metrics()
        self.service: KVStoreService | None = None
        self.transport: UcxTransport | None = None

    async def start(self, server: aio.Server) -> None:
        self.transport = await UcxTransport.create(self.metrics)
        self.service = KVStoreService(self.settings, self.transport, KVStoreMetrics(self.metrics))
        await self.service.start()
        kvstore_pb2_grpc.add_KVStoreServicer_to_server(KVStoreServicer(self.service), server)
        s = self.service.store
        log.info(
            "kvstore ready",
            capacity_bytes=s.arena.capacity_bytes,
            extent_bytes=s.arena.extent_bytes,
            block_bytes=self.settings.block_bytes,
            disk_dir=self.settings.disk_dir,
            disk_bytes=s.index.disk_capacity,
        )

    async def close(self) -> None:
        if self.service is not None:
            await self.service.close()
        if self.transport is not None:
            await self.transport.close()
