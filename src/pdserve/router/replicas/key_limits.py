"""Per-key limits that hold across router replicas (the admission stage's shared half).

Concurrency: a sorted set per key in the shared store, one member per running stream
(a lease: member = lease id, score = expiry in the store's own clock). One Lua script
drops expired leases, counts, and adds the new one only under the limit: atomic, so two
replicas never both take the last slot. Leases are renewed every ttl/3 while their
streams run; a dead replica's leases expire within `lease_ttl_s`, freeing its slots.

Tokens per minute: every second each replica publishes, per limited key, what it booked
in the last 60 s (a hash field per replica, stamped), and reads the others'; a request is
refused when its key's total reaches the limit (up to one second stale).

The store down: each replica enforces its share of the limit, ceil(limit / replicas
known), counted locally, and logs that it does (the store's gauge says so too). No
request is refused because the store is down.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import Callable

from .store import SharedStore, StoreDown, log

PREFIX = "pdserve:key:"
USAGE_STALE_S = 5.0  # a replica's published usage older than this is ignored (it died)

_ACQUIRE = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local n = redis.call('ZCARD', KEYS[1])
if n >= tonumber(ARGV[2]) then return -n end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[3]) * 2)
return n + 1
"""

_RENEW = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 1, #ARGV - 1 do
  redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[#ARGV]), ARGV[i])
end
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[#ARGV]) * 2)
return 1
"""


def _lease_key(name: str) -> str:
    return f"{PREFIX}{name}:streams"


def _usage_key(name: str) -> str:
    return f"{PREFIX}{name}:tokens"


class SharedKeyLimits:
    """What `scheduling.admission.Admission` asks across replicas (see the module doc)."""

    def __init__(
        self,
        store: SharedStore,
        me: str,
        replicas: Callable[[], int],
        lease_ttl_s: float = 10.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store, self.me = store, me
        self._replicas = replicas  # router replicas known now (cluster/peers.py)
        self.lease_ttl_s = lease_ttl_s
        self._clock = clock
        self._leases: dict[str, set[str]] = {}  # key name -> lease ids held here
        self._local_used: dict[str, Callable[[], int]] = {}  # tokens booked here (60 s)
        self._others_used: dict[str, int] = {}  # tokens the other replicas booked (60 s)
        self._tasks: list[asyncio.Task] = []
        self._pending: set[asyncio.Task] = set()
        self.degraded = 0  # admissions decided by the local share (store down)

    def share(self, limit: int) -> int:
        """This replica's part of `limit` while the store is down."""
        return max(1, math.ceil(limit / max(1, self._replicas())))

    async def acquire(self, key: str, limit: int, running_here: int) -> str | None:
        """A lease id, "" (admitted by the local share: the store is down), or None when
        the key already runs `limit` streams across the replicas. `running_here`: this
        key's streams on this replica, not counting the new one."""
        lease = f"{self.me}:{secrets.token_hex(6)}"
        ttl_ms = int(self.lease_ttl_s * 1000)
        redis = self.store.redis
        try:
            n = await self.store.call(
                lambda: redis.eval(_ACQUIRE, 1, _lease_key(key), lease, limit, ttl_ms)
            )
        except StoreDown:
            self.degraded += 1
            if running_here >= self.share(limit):
                return None
            log.debug("key limit by local share (shared store down)", key=key)
            return ""
        if int(n) < 0:
            return None
        self._leases.setdefault(key, set()).add(lease)
        return lease

    def release(self, key: str, lease: str | None) -> None:
        """Give a lease back (in the background: never blocks the request's end)."""
        if not lease:
            return
        held = self._leases.get(key)
        if held is not None:
            held.discard(lease)
            if not held:
                del self._leases[key]
        task = asyncio.ensure_future(self._remove(key, lease))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _remove(self, key: str, lease: str) -> None:
        redis = self.store.redis
        with contextlib.suppress(StoreDown):  # (it expires by itself)
            await self.store.call(lambda: redis.zrem(_lease_key(key), lease))

    async def renew_once(self) -> None:
        redis = self.store.redis
        ttl_ms = int(self.lease_ttl_s * 1000)
        for key, leases in list(self._leases.items()):
            members = list(leases)
            if not members:
                continue
            with contextlib.suppress(StoreDown):
                await self.store.call(
                    lambda key=key, members=members: redis.eval(
                        _RENEW, 1, _lease_key(key), *members, ttl_ms
                    )
                )

    # -- tokens per minute
    def track_usage(self, key: str, used: Callable[[], int]) -> None:
        """Publish this key's usage here (`used()`: tokens booked in the last 60 s)."""
        self._local_used.setdefault(key, used)

    def others_used(self, key: str) -> int:
        """Tokens the other replicas booked for `key` in the last 60 s (0: none or unknown)."""
        return self._others_used.get(key, 0)

    async def sync_usage_once(self) -> None:
        redis = self.store.redis
        now_ms = int(self._clock() * 1000)
        for key, used in list(self._local_used.items()):
            try:
                fields = await self.store.call(
                    lambda key=key, used=used: _publish_and_read(
                        redis, key, self.me, used(), now_ms
                    )
                )
            except StoreDown:
                self._others_used.pop(key, None)  # the local share applies instead
                continue
            total = 0
            for replica, value in (fields or {}).items():
                if replica == self.me:
                    continue
                tokens, _, stamp = str(value).partition(":")
                if stamp and now_ms - int(stamp) <= USAGE_STALE_S * 1000:
                    total += int(tokens)
            self._others_used[key] = total

    # -- life
    async def _every(self, period_s: float, fn: Callable[[], object]) -> None:
        while True:
            await asyncio.sleep(period_s)
            try:
                await fn()  # type: ignore[misc]
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("shared key limits: background step failed")

    def start(self) -> None:
        self._tasks = [
            asyncio.ensure_future(self._every(self.lease_ttl_s / 3, self.renew_once)),
            asyncio.ensure_future(self._every(1.0, self.sync_usage_once)),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._pending:
            await asyncio.gather(*self._pending, return_exceptions=True)
        redis = self.store.redis
        for key, leases in list(self._leases.items()):  # hand the slots back at once
            with contextlib.suppress(StoreDown):
                await self.store.call(
                    lambda key=key, leases=leases: redis.zrem(_lease_key(key), *leases)
                )
        self._leases.clear()


async def _publish_and_read(redis, key: str, me: str, used: int, now_ms: int) -> dict:
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(_usage_key(key), me, f"{used}:{now_ms}")
        pipe.pexpire(_usage_key(key), 120_000)
        pipe.hgetall(_usage_key(key))
        results = await pipe.execute()
    return results[-1]
