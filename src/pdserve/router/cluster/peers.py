"""The router replicas this router knows of, learned from the workers (no gossip): each
worker reports, with every heartbeat, the routers it is registered with now. A replica
lists itself and every router some live worker reports; a router that died drops out
once the workers' links to it fail (one heartbeat)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class RouterIdentity:
    """One router replica as clients reach it."""

    router_id: str
    address: str = ""  # public gRPC HOST:PORT
    http_address: str = ""  # OpenAI HTTP HOST:PORT ("" when off)


@dataclass(frozen=True)
class KnownRouter:
    identity: RouterIdentity
    workers: int  # live workers that report it (itself: the workers it has registered)
    is_self: bool


class PeerRouters:
    """instance id -> the routers that worker reports (forgotten with the instance)."""

    def __init__(self, me: RouterIdentity) -> None:
        self.me = me
        self._by_instance: dict[str, tuple[RouterIdentity, ...]] = {}

    def report(self, instance_id: str, routers: Iterable[RouterIdentity]) -> None:
        self._by_instance[instance_id] = tuple(r for r in routers if r.router_id)

    def forget(self, instance_id: str) -> None:
        self._by_instance.pop(instance_id, None)

    def known(self, live_instances: Iterable[str]) -> list[KnownRouter]:
        """Itself first, then the others by id; `live_instances`: the registry's now."""
        live = set(live_instances)
        counts: dict[str, int] = {}
        ids: dict[str, RouterIdentity] = {}
        for iid, routers in self._by_instance.items():
            if iid not in live:
                continue
            for r in routers:
                counts[r.router_id] = counts.get(r.router_id, 0) + 1
                ids[r.router_id] = r
        out = [KnownRouter(self.me, len(live), True)]
        for rid in sorted(ids):
            if rid != self.me.router_id:
                out.append(KnownRouter(ids[rid], counts[rid], False))
        return out
