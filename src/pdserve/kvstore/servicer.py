"""KVStore gRPC servicer: proto <-> domain only (the logic is in service.py / store.py)."""

from __future__ import annotations

from grpc import aio

from pdserve.kvstore.service import KVStoreService
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, service: KVStoreService) -> None:
        self.service = service

    async def Lookup(self, request, context: aio.ServicerContext):
        hashes = list(request.block_hashes)
        n = self.service.lookup(request.namespace, hashes)
        return kvstore_pb2.LookupResponse(
            num_hit_blocks=n,
            ucx_worker_address=self.service.address,
            bytes_per_block=self.service.bytes_per_block(request.namespace, hashes),
        )

    async def Fetch(self, request, context: aio.ServicerContext):
        r = await self.service.fetch(
            request.namespace, list(request.block_hashes), request.ucx_worker_address, request.tag
        )
        return kvstore_pb2.FetchResponse(
            num_blocks=r.num_blocks, bytes_per_block=r.bytes_per_block, checksums=r.checksums
        )

    async def BeginPut(self, request, context: aio.ServicerContext):
        t = self.service.begin_put(
            request.namespace,
            list(request.block_hashes),
            request.first_block,
            request.bytes_per_block,
        )
        return kvstore_pb2.BeginPutResponse(
            put_id=t.put_id,
            tag=t.tag,
            ucx_worker_address=self.service.address,
            num_accepted=t.num_accepted,
            first_block=t.first_block,
        )

    async def CommitPut(self, request, context: aio.ServicerContext):
        n = await self.service.commit_put(request.put_id, list(request.checksums))
        return kvstore_pb2.CommitPutResponse(num_stored=n)

    async def Pin(self, request, context: aio.ServicerContext):
        n = self.service.pin(request.namespace, list(request.block_hashes), 1)
        return kvstore_pb2.PinResponse(num_blocks=n)

    async def Unpin(self, request, context: aio.ServicerContext):
        n = self.service.pin(request.namespace, list(request.block_hashes), -1)
        return kvstore_pb2.PinResponse(num_blocks=n)

    async def Clear(self, request, context: aio.ServicerContext):
        return kvstore_pb2.ClearResponse(num_blocks=self.service.clear(request.namespace))

    async def Stats(self, request, context: aio.ServicerContext):
        return kvstore_pb2.StatsResponse(**self.service.stats().as_dict())
