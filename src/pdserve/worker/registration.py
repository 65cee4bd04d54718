"""Register with the router and heartbeat the load until stopped.

The router forgets an instance that stops heartbeating; `known=false` in a heartbeat reply
means it did, so we register again. The router being down is not fatal: we retry.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable

import grpc

from pdserve.logging import get_logger
from pdserve.rpc.channels import make_channel
from pdserve.v1 import router_pb2, router_pb2_grpc
from pdserve.worker import convert
from pdserve.worker.core import WorkerCore

_log = get_logger(__name__)


def advertised_address(host: str, port: int, advertise_host: str | None) -> str:
    """The address the router dials: explicit, else the bind host, else this host's IP
    (a wildcard bind, e.g. in a container)."""
    if advertise_host:
        return f"{advertise_host}:{port}"
    if host not in ("0.0.0.0", "::", ""):
        return f"{host}:{port}"
    try:
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return f"127.0.0.1:{port}"


class Registration:
    def __init__(
        self,
        core: WorkerCore,
        router_addr: str,
        address: str,
        on_kvstore: Callable[[str], None] | None = None,
    ) -> None:
        self._core = core
        self._router_addr = router_addr
        self._address = address
        self._on_kvstore = on_kvstore
        self._task: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None
        self.registered = asyncio.Event()

    def start(self) -> None:
        self._channel = make_channel(self._router_addr)
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._channel is not None:
            with contextlib.suppress(Exception):
                stub = router_pb2_grpc.RegistryStub(self._channel)
                await stub.Deregister(
                    router_pb2.DeregisterRequest(instance_id=self._core.instance_id), timeout=2
                )
            await self._channel.close()

    async def _run(self) -> None:
        assert self._channel is not None
        stub = router_pb2_grpc.RegistryStub(self._channel)
        while True:
            try:
                interval = await self._register(stub)
                self.registered.set()
                await self._heartbeat_until_forgotten(stub, interval)
                _log.warning("router forgot this instance; registering again")
            except grpc.aio.AioRpcError as exc:
                self.registered.clear()
                _log.warning("router unreachable", code=exc.code().name, details=exc.details())
                await asyncio.sleep(1.0)

    async def _register(self, stub: router_pb2_grpc.RegistryStub) -> float:
        core = self._core
        resp = await stub.Register(
            router_pb2.RegisterRequest(
                instance_id=core.instance_id,
                address=self._address,
                role=convert.ROLE_TO_PROTO[core.role],
                model_fingerprint=core.engine.model_fingerprint,
                block_size=core.engine.spec.block_size,
                load=core.load_snapshot().to_proto(),
                dtype=core.engine.dtype,  # the compute dtype (the KV dtype may be int8/fp8)
                kernels=core.kernels_summary,
            ),
            timeout=5.0,
        )
        _log.info("registered", router=self._router_addr, address=self._address, pid=os.getpid())
        if resp.kvstore_address and self._on_kvstore is not None:
            self._on_kvstore(resp.kvstore_address)
        return resp.heartbeat_interval_s or core.settings.heartbeat_interval_s

    async def _heartbeat_until_forgotten(
        self, stub: router_pb2_grpc.RegistryStub, interval: float
    ) -> None:
        """Report the load every `interval` seconds; return when the router forgot us."""
        while True:
            if not await self._heartbeat(stub):
                return
            await asyncio.sleep(interval)

    async def _heartbeat(self, stub: router_pb2_grpc.RegistryStub) -> bool:
        core = self._core
        resp = await stub.Heartbeat(
            router_pb2.HeartbeatRequest(
                instance_id=core.instance_id,
                role=convert.ROLE_TO_PROTO[core.role],
                state=core.state,
                load=core.load_snapshot().to_proto(),
            ),
            timeout=5.0,
        )
        return resp.known
