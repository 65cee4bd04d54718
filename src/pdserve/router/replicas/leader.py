"""One replica at a time may flip instances: the holder of a lock in the shared store
(`SET key me NX PX ttl`, renewed every ttl/3 by a compare-and-renew script). A replica
flips only while its last renewal is younger than the ttl minus a margin, so two replicas
never decide flips at the same time; the worker refuses a second SetRole while it flips
(the backstop). Without a configured store a router is alone and always leads; with a
store that does not answer, nobody flips (safe)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from .store import SharedStore, StoreDown, log

LOCK_KEY = "pdserve:flip-leader"
MARGIN = 0.5  # of the ttl: stop leading this long before the lock could expire

_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""


class Leadership:
    def __init__(
        self,
        store: SharedStore | None,
        me: str,
        ttl_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
        on_gained: Callable[[], None] | None = None,
    ) -> None:
        self.store, self.me, self.ttl_s = store, me, ttl_s
        self._clock = clock
        self._held_at: float | None = None  # monotonic time of the last acquire/renew
        self._on_gained = on_gained or (lambda: None)

    def is_leader(self) -> bool:
        if self.store is None:
            return True
        return self._held_at is not None and self._clock() - self._held_at < self.ttl_s * MARGIN

    async def tick(self) -> bool:
        """Acquire or renew the lock once; whether this replica leads now."""
        if self.store is None:
            return True
        redis, ttl_ms = self.store.redis, int(self.ttl_s * 1000)
        before = self.is_leader()
        started = self._clock()
        try:
            if self._held_at is not None:
                ok = await self.store.call(lambda: redis.eval(_RENEW, 1, LOCK_KEY, self.me, ttl_ms))
            else:
                ok = await self.store.call(lambda: redis.set(LOCK_KEY, self.me, nx=True, px=ttl_ms))
        except StoreDown:
            ok = False
        if ok:
            self._held_at = started  # (the lock's ttl started no earlier than this)
        else:
            self._held_at = None
        now = self.is_leader()
        if now and not before:
            log.info("flip leadership gained", router_id=self.me)
            self._on_gained()
        elif before and not now:
            log.warning("flip leadership lost", router_id=self.me)
        return now

    async def run(self) -> None:
        while True:
            await self.tick()
            await asyncio.sleep(self.ttl_s / 3)

    async def release(self) -> None:
        """Hand the lock on at shutdown (only if this replica holds it)."""
        if self.store is None or self._held_at is None:
            return
        redis = self.store.redis
        script = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
        try:
            await self.store.call(lambda: redis.eval(script, 1, LOCK_KEY, self.me))
        except StoreDown:
            pass
        self._held_at = None
