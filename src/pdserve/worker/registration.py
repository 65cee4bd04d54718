"""Register with every router replica and heartbeat the load to each, until stopped.

The workers are the cluster's truth (docs/ARCHITECTURE.md, "Router replicas"): a worker
keeps one independent link per router (`RouterLink`: register, then heartbeat every
interval), so each replica learns every worker, its load and its role from the worker
itself, and a replica that restarts re-learns everything within one heartbeat. A router
being down is not fatal: that link retries while the others go on. `known=false` in a
heartbeat reply means that router forgot us: we register again.

`--router-addr` lists the routers (HOST:PORT, comma-separated). With
`--router-discovery dns` each entry's host is resolved every `router_resolve_s` seconds and
every address it resolves to gets its own link (a Kubernetes headless Service).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Sequence

import grpc

from pdserve.logging import get_logger
from pdserve.rpc.channels import make_channel
from pdserve.v1 import router_pb2, router_pb2_grpc
from pdserve.worker import convert
from pdserve.worker.core import WorkerCore

_log = get_logger(__name__)
RETRY_S = 1.0  # a link whose router is unreachable tries again this often
# A restarted router is reached on the next try, not after grpc's reconnect back-off (which
# grows to 120 s while a router is down): every router re-learns the workers within ~1 s.
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", int(RETRY_S * 1000)),
)


def split_addrs(router_addr: str) -> list[str]:
    """'a:1, b:2' -> ['a:1', 'b:2'] (each once, in order)."""
    return list(dict.fromkeys(a.strip() for a in router_addr.split(",") if a.strip()))


class RouterLink:
    """Registration with, and heartbeats to, one router."""

    def __init__(
        self,
        core: WorkerCore,
        router_addr: str,
        address: str,
        report: Callable[[], Sequence[router_pb2.PeerRouter]],
        on_kvstore: Callable[[str], None] | None = None,
    ) -> None:
        self._core = core
        self.router_addr = router_addr
        self._address = address
        self._report = report  # the routers this worker is registered with (heartbeats)
        self._on_kvstore = on_kvstore
        self._task: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None
        self.registered = asyncio.Event()
        self.peer: router_pb2.PeerRouter | None = None  # who answered, while registered

    def start(self) -> None:
        self._channel = make_channel(self.router_addr, options=RECONNECT_OPTIONS)
        self._task = asyncio.ensure_future(self._run())

    async def stop(self, deregister: bool = True) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._channel is not None:
            if deregister:
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
                _log.warning(
                    "router forgot this instance; registering again", router=self.router_addr
                )
            except grpc.aio.AioRpcError as exc:
                if self.registered.is_set() or self.peer is None:
                    _log.warning(
                        "router unreachable", router=self.router_addr, code=exc.code().name,
                        details=exc.details(),
                    )  # fmt: skip
                self.registered.clear()
                await asyncio.sleep(RETRY_S)
            self.registered.clear()

    def _learn(self, peer: router_pb2.PeerRouter) -> None:
        if peer.router_id:
            self.peer = peer

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
            ),
            timeout=5.0,
        )
        self._learn(resp.router)
        _log.info(
            "registered", router=self.router_addr, router_id=resp.router.router_id or None,
            address=self._address, pid=os.getpid(),
        )  # fmt: skip
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
                routers=self._report(),
            ),
            timeout=5.0,
        )
        self._learn(resp.router)
        return resp.known


class Registration:
    """One `RouterLink` per router replica (see the module docstring)."""

    def __init__(
        self,
        core: WorkerCore,
        router_addr: str,
        address: str,
        on_kvstore: Callable[[str], None] | None = None,
        discovery: str = "static",
        resolve_s: float = 5.0,
    ) -> None:
        self._core = core
        self._entries = split_addrs(router_addr)
        if not self._entries:
            raise ValueError(f"no router address in {router_addr!r}")
        self._address = address
        self._on_kvstore = on_kvstore
        self._discovery = discovery
        self._resolve_s = resolve_s
        self.links: dict[str, RouterLink] = {}
        self._task: asyncio.Task | None = None
        self._stopping: set[asyncio.Task] = set()

    @property
    def registered(self) -> bool:
        """Registered with at least one router."""
        return any(link.registered.is_set() for link in self.links.values())

    def routers(self) -> list[router_pb2.PeerRouter]:
        """The routers this worker is registered with now (what heartbeats report)."""
        return [
            link.peer
            for link in self.links.values()
            if link.registered.is_set() and link.peer is not None
        ]

    def start(self) -> None:
        if self._discovery == "dns":
            self._task = asyncio.ensure_future(self._resolve_loop())
        else:
            self._reconcile(self._entries)

    def _reconcile(self, addrs: Sequence[str]) -> None:
        for addr in addrs:
            if addr not in self.links:
                link = RouterLink(self._core, addr, self._address, self.routers, self._on_kvstore)
                self.links[addr] = link
                link.start()
                _log.info("router link started", router=addr)
        for addr in [a for a in self.links if a not in addrs]:
            link = self.links.pop(addr)
            task = asyncio.ensure_future(link.stop(deregister=False))  # (the replica went away)
            self._stopping.add(task)
            task.add_done_callback(self._stopping.discard)
            _log.info("router link dropped (no longer resolved)", router=addr)

    async def _resolve_loop(self) -> None:
        while True:
            addrs = await resolve_all(self._entries)
            if addrs:  # a failed lookup keeps the links we have
                self._reconcile(addrs)
            await asyncio.sleep(self._resolve_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        links, self.links = list(self.links.values()), {}
        await asyncio.gather(*(link.stop() for link in links))


async def resolve_all(entries: Sequence[str]) -> list[str]:
    """Every IPv4/IPv6 address each HOST:PORT entry resolves to, as ADDR:PORT."""
    loop = asyncio.get_running_loop()
    out: list[str] = []
    for entry in entries:
        host, _, port = entry.rpartition(":")
        try:
            infos = await loop.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
        except (OSError, ValueError) as exc:
            _log.warning("router address does not resolve", router=entry, error=str(exc))
            continue
        for _family, _type, _proto, _name, sockaddr in infos:
            ip = sockaddr[0]
            out.append(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}")
    return list(dict.fromkeys(out))
