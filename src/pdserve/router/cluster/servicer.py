"""gRPC servicer of the internal plane: Registry (Register, Heartbeat, Deregister) for
workers; proto <-> domain only. Domain errors raised here are mapped to status codes by
pdserve.rpc's ErrorInterceptor."""

from __future__ import annotations

from pdserve.logging import get_logger
from pdserve.rpc.ids import check_id
from pdserve.v1 import router_pb2, router_pb2_grpc

from .peers import PeerRouters, RouterIdentity
from .registry import LoadReport, Registry
from .registry_checks import Owners, check_heartbeat, check_register

log = get_logger("pdserve.router")


class RegistryServicer(router_pb2_grpc.RegistryServicer):
    def __init__(
        self,
        registry: Registry,
        heartbeat_interval_s: float,
        kvstore_addr: str = "",
        max_instances_per_identity: int = 0,
        peers: PeerRouters | None = None,
    ) -> None:
        self.registry = registry
        self.heartbeat_interval_s = heartbeat_interval_s
        self.kvstore_addr = kvstore_addr
        self.owners = Owners(max_instances_per_identity)
        self.peers = peers if peers is not None else PeerRouters(RouterIdentity(""))

    def _me(self) -> router_pb2.PeerRouter:
        me = self.peers.me  # read per call: the address is known once the router serves
        return router_pb2.PeerRouter(
            router_id=me.router_id, address=me.address, http_address=me.http_address
        )

    def _check_owner(self, instance_id: str) -> None:
        self.owners.check(instance_id, self.registry.get(instance_id) is not None)

    async def Register(
        self, request: router_pb2.RegisterRequest, context
    ) -> router_pb2.RegisterResponse:
        check_register(request)
        self._check_owner(request.instance_id)
        self.owners.check_quota(
            request.instance_id, {i.instance_id for i in self.registry.instances()}
        )
        inst = self.registry.register(
            request.instance_id,
            request.address,
            request.role,
            request.model_fingerprint,
            request.block_size,
            LoadReport.from_proto(request.load),
            request.dtype,
        )
        self.owners.claim(inst.instance_id)
        log.info(
            "instance registered",
            instance=inst.instance_id,
            address=inst.address,
            role=inst.role_name,
        )
        return router_pb2.RegisterResponse(
            heartbeat_interval_s=self.heartbeat_interval_s,
            kvstore_address=self.kvstore_addr,
            router=self._me(),
        )

    async def Heartbeat(
        self, request: router_pb2.HeartbeatRequest, context
    ) -> router_pb2.HeartbeatResponse:
        check_heartbeat(request)
        self._check_owner(request.instance_id)
        known = self.registry.heartbeat(
            request.instance_id, request.role, request.state, LoadReport.from_proto(request.load)
        )
        if known:
            self.peers.report(
                request.instance_id,
                (RouterIdentity(r.router_id, r.address, r.http_address) for r in request.routers),
            )
        return router_pb2.HeartbeatResponse(known=known, router=self._me())

    async def Deregister(
        self, request: router_pb2.DeregisterRequest, context
    ) -> router_pb2.DeregisterResponse:
        check_id("instance_id", request.instance_id)
        self._check_owner(request.instance_id)
        self.owners.release(request.instance_id)
        if self.registry.deregister(request.instance_id):
            log.info("instance deregistered", instance=request.instance_id)
        return router_pb2.DeregisterResponse()
