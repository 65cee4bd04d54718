"""KVStore gRPC servicer: proto <-> domain only (the logic is in service.py / store.py).

Every field is checked first (pdserve.kvstore.checks). Puts are bound to the caller's
identity (its certificate URI, from the authorization interceptor): the blocks remember
their writer, and only the identity that began a put may commit it."""

from __future__ import annotations

from grpc import aio

from pdserve.kvstore import checks
from pdserve.kvstore.service import KVStoreService
from pdserve.rpc.authz import current_peer
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc


def _writer() -> str:
    peer = current_peer()
    return peer.uri if peer is not None else ""


class KVStoreServicer(kvstore_pb2_grpc.KVStoreServicer):
    def __init__(self, service: KVStoreService) -> None:
        self.service = service

    async def Lookup(self, request, context: aio.ServicerContext):
        hashes = list(request.block_hashes)
        checks.check_chain(request.namespace, hashes)
        main = 0  # unset for uniform models: their reply is unchanged
        if request.window_blocks:
            n, main = self.service.lookup_window(request.namespace, hashes, request.window_blocks)
        else:
            n = self.service.lookup(request.namespace, hashes)
        return kvstore_pb2.LookupResponse(
            num_hit_blocks=n,
            ucx_worker_address=self.service.address,
            bytes_per_block=self.service.bytes_per_block(request.namespace, hashes),
            num_main_blocks=main,
        )

    async def Fetch(self, request, context: aio.ServicerContext):
        checks.check_chain(request.namespace, list(request.block_hashes), allow_empty=False)
        checks.check_ucx_address(request.ucx_worker_address)
        checks.check_tag(request.tag)
        r = await self.service.fetch(
            request.namespace,
            list(request.block_hashes),
            request.ucx_worker_address,
            request.tag,
            request.window_blocks,
        )
        return kvstore_pb2.FetchResponse(
            num_blocks=r.num_blocks,
            bytes_per_block=r.bytes_per_block,
            checksums=r.checksums,
            num_window_blocks=r.num_window_blocks,
            window_bytes_per_block=r.window_bytes_per_block,
        )

    async def BeginPut(self, request, context: aio.ServicerContext):
        hashes = list(request.block_hashes)
        checks.check_chain(request.namespace, hashes, allow_empty=False)
        checks.check_put(request.first_block, len(hashes), request.bytes_per_block)
        t = self.service.begin_put(
            request.namespace,
            hashes,
            request.first_block,
            request.bytes_per_block,
            _writer(),
            request.window_part,
        )
        return kvstore_pb2.BeginPutResponse(
            put_id=t.put_id,
            tag=t.tag,
            ucx_worker_address=self.service.address,
            num_accepted=t.num_accepted,
            first_block=t.first_block,
        )

    async def CommitPut(self, request, context: aio.ServicerContext):
        checks.check_checksums(request.checksums)
        n = await self.service.commit_put(request.put_id, list(request.checksums), _writer())
        return kvstore_pb2.CommitPutResponse(num_stored=n)

    async def Pin(self, request, context: aio.ServicerContext):
        checks.check_chain(request.namespace, list(request.block_hashes))
        n = self.service.pin(request.namespace, list(request.block_hashes), 1)
        return kvstore_pb2.PinResponse(num_blocks=n)

    async def Unpin(self, request, context: aio.ServicerContext):
        checks.check_chain(request.namespace, list(request.block_hashes))
        n = self.service.pin(request.namespace, list(request.block_hashes), -1)
        return kvstore_pb2.PinResponse(num_blocks=n)

    async def Clear(self, request, context: aio.ServicerContext):
        checks.check_namespace(request.namespace)
        return kvstore_pb2.ClearResponse(num_blocks=self.service.clear(request.namespace))

    async def Stats(self, request, context: aio.ServicerContext):
        return kvstore_pb2.StatsResponse(**self.service.stats().as_dict())

    async def PurgeWriter(self, request, context: aio.ServicerContext):
        checks.check_writer(request.writer)
        removed, in_use = self.service.purge_writer(request.writer)
        return kvstore_pb2.PurgeWriterResponse(num_blocks=removed, num_in_use=in_use)
