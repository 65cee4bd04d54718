"""What replicas agree on through the shared store, when the store is down (a fake store
for the logic; the real Redis runs in tests/integration/test_router_replicas.py): per-key
limits fall back to this replica's share, counted locally, nothing is refused for the
store being down; nobody flips; a router without a store is alone and leads."""

from __future__ import annotations

import pytest

from pdserve.errors import OverloadedError
from pdserve.router.frontdoor.auth import ApiKey
from pdserve.router.replicas.key_limits import SharedKeyLimits
from pdserve.router.replicas.leader import Leadership
from pdserve.router.replicas.store import SharedStore, StoreDown
from pdserve.router.scheduling.admission import Admission
from pdserve.rpc.metrics import Metrics


class DownRedis:
    """Every call fails as a dead server's would."""

    async def eval(self, *args):
        raise ConnectionRefusedError("connection refused")

    async def set(self, *args, **kwargs):
        raise ConnectionRefusedError("connection refused")

    async def zrem(self, *args):
        raise ConnectionRefusedError("connection refused")

    async def ping(self):
        raise ConnectionRefusedError("connection refused")


def _store() -> SharedStore:
    return SharedStore("redis://:secret@127.0.0.1:1/0", client=DownRedis())


async def test_store_down_is_described_without_the_password() -> None:
    store = _store()
    with pytest.raises(StoreDown):
        await store.call(store.redis.ping)
    assert not store.up and store.describe().startswith("redis down: ConnectionRefusedError")
    from pdserve.router.replicas.store import _safe

    assert _safe(store.url) == "redis://***@127.0.0.1:1/0"


async def test_key_limit_falls_back_to_the_local_share() -> None:
    limits = SharedKeyLimits(_store(), "r1", replicas=lambda: 2)
    assert limits.share(16) == 8 and limits.share(1) == 1
    assert await limits.acquire("k", 16, running_here=7) == ""  # admitted locally
    assert await limits.acquire("k", 16, running_here=8) is None  # its share is used
    assert limits.degraded == 2
    limits.release("k", "")  # a local admission holds no lease


async def test_admission_across_replicas_with_the_store_down() -> None:
    limits = SharedKeyLimits(_store(), "r1", replicas=lambda: 2)
    admission = Admission(Metrics(), shared=limits)
    key = ApiKey("team", max_concurrent=4)
    held = []
    for _ in range(2):  # this replica's share of 4 over 2 replicas
        cm = admission.admit(key)
        await cm.__aenter__()
        held.append(cm)
    with pytest.raises(OverloadedError, match="across the router replicas"):
        async with admission.admit(key):
            pass
    assert admission.state(key).running == 2  # the refused one left no count behind
    for cm in held:
        await cm.__aexit__(None, None, None)
    assert admission.state(key).running == 0


async def test_leadership() -> None:
    alone = Leadership(None, "r1")
    assert alone.is_leader() and await alone.tick()  # no store: a router alone leads
    down = Leadership(_store(), "r1")
    assert not await down.tick() and not down.is_leader()  # store down: nobody flips


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class LockRedis:
    """A lock that SET NX grants once and the renew script keeps for its holder."""

    def __init__(self) -> None:
        self.holder: str | None = None

    async def set(self, key, value, nx=False, px=0):
        if self.holder is None:
            self.holder = value
            return True
        return None

    async def eval(self, script, n, key, me, *args):
        return 1 if self.holder == me else 0


async def test_one_leader_and_it_stops_leading_before_its_lock_can_expire() -> None:
    redis, clock = LockRedis(), Clock()
    a = Leadership(SharedStore("redis://x", client=redis), "a", ttl_s=10, clock=clock)
    b = Leadership(SharedStore("redis://x", client=redis), "b", ttl_s=10, clock=clock)
    assert await a.tick() and not await b.tick()
    clock.t += 4.9
    assert a.is_leader()
    clock.t += 0.2  # renewals missed for half the ttl: it stops deciding flips
    assert not a.is_leader()
    assert await a.tick()  # renewed
