"""Placement policies: which prefill / decode instance serves a request.

Contract: `pick_prefill` / `pick_decode` get a non-empty candidate list (sorted
by instance id, already filtered to live, serving, non-suspect instances) and
return one of them. `on_routed` is told where a request went (policies that
learn, e.g. prefix-aware, update their state there); `forget` drops state for
an instance that left. Policies never do I/O.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..cluster.registry import Instance


@dataclass
class RouteRequest:
    request_id: str
    token_ids: Sequence[int]
    predicted_tokens: int = 0  # p50 of the output-length prediction
    session_id: str = ""
    predicted_p90: int = 0
    reserve_tokens: int = 0  # decode KV headroom asked for beyond the prompt
    # Chained block hashes per block size, computed lazily by `hashes_for`.
    _hashes: dict[int, list[bytes]] = field(default_factory=dict, repr=False)
    hasher: Callable[[Sequence[int], int], list[bytes]] | None = field(default=None, repr=False)

    def hashes_for(self, block_size: int) -> list[bytes]:
        if self.hasher is None or block_size <= 0:
            return []
        if block_size not in self._hashes:
            self._hashes[block_size] = self.hasher(self.token_ids, block_size)
        return self._hashes[block_size]


class PlacementPolicy(ABC):
    name: str = "base"

    @abstractmethod
    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        """Also used to pick a colocated instance."""

    @abstractmethod
    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance: ...

    def on_routed(
        self, request: RouteRequest, prefill: Instance | None, decode: Instance | None
    ) -> None:
        """The request was placed (prefill may be a colocated instance)."""
        return None

    def forget(self, instance_id: str) -> None:
        """The instance left the registry."""
        return None


class RoundRobin(PlacementPolicy):
    """Cycles through the candidates, one counter per phase."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = {"prefill": 0, "decode": 0}

    def _pick(self, phase: str, candidates: Sequence[Instance]) -> Instance:
        idx = self._next[phase] % len(candidates)
        self._next[phase] += 1
        return candidates[idx]

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return self._pick("prefill", candidates)

    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return self._pick("decode", candidates)


def prefill_load(inst: Instance) -> tuple[float, ...]:
    """Lower is better: tokens this router has in flight there, then reported queue."""
    return (inst.inflight_tokens, inst.load.tokens_in_flight, inst.load.num_waiting)


def decode_load(inst: Instance) -> tuple[float, ...]:
    """Lower is better: running requests (router view, then reported), then free blocks."""
    return (
        inst.inflight_requests,
        inst.load.num_running + inst.load.num_reserved,
        -inst.load.free_blocks,
    )


class LeastLoaded(PlacementPolicy):
    name = "least_loaded"

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return min(candidates, key=prefill_load)  # min is stable: ties -> lowest id

    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return min(candidates, key=decode_load)


class PrefixAware(LeastLoaded):
    """Prefers the prefill instance where the prompt costs least: the router remembers, per
    instance, an LRU of the block hashes it routed there (sized to the instance's reported
    block pool, as the engine's own prefix cache is), and charges each candidate its queued
    prompt tokens plus the tokens of this prompt it does not hold. A match therefore wins
    exactly when the compute it saves exceeds the extra queue it lands in, and never while the
    holder is more than `balance_tokens` busier than the least loaded (one hot prefix cannot
    pin the pool)."""

    name = "prefix_aware"

    def __init__(
        self, capacity_blocks: int = 4096, balance_tokens: int = 65536, max_blocks: int = 1 << 17
    ) -> None:
        self.capacity_blocks = capacity_blocks  # when an instance reports no pool size
        self.balance_tokens = balance_tokens
        self.max_blocks = max_blocks  # the router's memory per instance (~100 B per hash)
        self._lru: dict[str, OrderedDict[bytes, None]] = {}

    def matched_blocks(self, inst: Instance, hashes: Sequence[bytes]) -> int:
        lru = self._lru.get(inst.instance_id)
        if not lru:
            return 0
        n = 0
        for h in hashes:  # chained hashes: a prefix match stops at the first miss
            if h not in lru:
                break
            n += 1
        return n

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        least = super().pick_prefill(request, candidates)
        limit = least.inflight_tokens + self.balance_tokens

        def cost(inst: Instance) -> tuple[int, bool]:
            # queued tokens + the prompt's tokens it does not hold (the prompt's length is the
            # same for all, so it drops out); ties: the least loaded, then the first
            held = self.matched_blocks(inst, request.hashes_for(inst.block_size)) * inst.block_size
            return inst.inflight_tokens - held, inst is not least

        return min((i for i in candidates if i.inflight_tokens <= limit), key=cost)

    def on_routed(
        self, request: RouteRequest, prefill: Instance | None, decode: Instance | None
    ) -> None:
        if prefill is None:
            return
        lru = self._lru.setdefault(prefill.instance_id, OrderedDict())
        for h in request.hashes_for(prefill.block_size):
            lru[h] = None
            lru.move_to_end(h)
        cap = min(prefill.load.total_blocks or self.capacity_blocks, self.max_blocks)
        while len(lru) > cap:
            lru.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        self._lru.pop(instance_id, None)


class SessionAffinity(PlacementPolicy):
    """Same session_id -> same prefill (or colocated) instance while it lives;
    everything else is decided by the wrapped policy. Bounded LRU with a TTL."""

    def __init__(
        self,
        inner: PlacementPolicy,
        max_sessions: int = 65536,
        ttl_s: float = 3600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.inner = inner
        self.name = f"{inner.name}+session"
        self.max_sessions = max_sessions
        self.ttl_s = ttl_s
        self._clock = clock
        self._sessions: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        if request.session_id:
            entry = self._sessions.get(request.session_id)
            if entry is not None and self._clock() - entry[1] <= self.ttl_s:
                for inst in candidates:
                    if inst.instance_id == entry[0]:
                        return inst
        return self.inner.pick_prefill(request, candidates)

    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return self.inner.pick_decode(request, candidates)

    def on_routed(
        self, request: RouteRequest, prefill: Instance | None, decode: Instance | None
    ) -> None:
        self.inner.on_routed(request, prefill, decode)
        if request.session_id and prefill is not None:
            self._sessions[request.session_id] = (prefill.instance_id, self._clock())
            self._sessions.move_to_end(request.session_id)
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)

    def forget(self, instance_id: str) -> None:
        self.inner.forget(instance_id)
        for sid in [s for s, (iid, _) in self._sessions.items() if iid == instance_id]:
            del self._sessions[sid]

    def session_instance(self, session_id: str) -> str | None:
        entry = self._sessions.get(session_id)
        return entry[0] if entry else None


POLICIES: dict[str, Callable[[], PlacementPolicy]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
    "prefix_aware": PrefixAware,
}
