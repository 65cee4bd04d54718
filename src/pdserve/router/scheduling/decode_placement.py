"""Decode placements wrapped around a placement policy (`policies.make_policy`): the inner
policy places prefills (and colocated requests); these choose the decode instance from the
request's predicted length.

- `PredictedFootprint` ("predicted"): least predicted KV footprint and batch over the
  request's predicted lifetime.
- `LengthRouted` ("length"): for a decode pool of mixed memory, answers predicted long go to
  the decodes with the most KV, the others to the rest.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cluster.registry import Instance
from .demand import DecodeDemand
from .policies import PlacementPolicy, RouteRequest, decode_load

DECODE_PLACEMENTS = ("count", "predicted", "length")


class PredictedFootprint(PlacementPolicy):
    """Decode placement by predicted footprint over the new request's predicted lifetime
    h (its p50), from what the router placed on each instance (demand.DecodeDemand):
      - KV: the instance's predicted peak over [0, h] -- every placed request's prompt +
        generated tokens, grown by min(its predicted remaining, h) -- plus the new
        request's prompt + h, as a fraction of the instance's KV capacity; above 1 the
        request would wait for blocks or cause preemptions, so overflow is penalised;
      - batch: the expected number of sequences decoding alongside it, each placed
        request weighted by the fraction of h it is predicted to still run (a request
        about to finish barely counts; a long one counts fully), which sets its TPOT.
    Lower (overflow, batch, KV fraction) wins; ties go to the policy's count order.
    Prefill is the inner policy's choice."""

    def __init__(self, inner: PlacementPolicy, demand: DecodeDemand) -> None:
        self.inner = inner
        self.demand = demand
        self.name = f"{inner.name}+predicted_kv"

    def decode_cost(self, request: RouteRequest, inst: Instance) -> tuple[float, float, float]:
        h = max(1, request.predicted_tokens)
        batch = 1.0
        peak = len(request.token_ids) + h
        for p in self.demand.placements(inst.instance_id):
            grow = min(self.demand.remaining(p), h)
            batch += grow / h
            peak += p.prompt_tokens + p.generated + grow
        capacity = inst.load.total_blocks * inst.block_size
        frac = peak / capacity if capacity > 0 else 0.0
        return (max(0.0, frac - 1.0), round(batch, 6), frac)

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return self.inner.pick_prefill(request, candidates)

    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return min(candidates, key=lambda i: (*self.decode_cost(request, i), decode_load(i)))

    def on_routed(
        self, request: RouteRequest, prefill: Instance | None, decode: Instance | None
    ) -> None:
        self.inner.on_routed(request, prefill, decode)

    def forget(self, instance_id: str) -> None:
        self.inner.forget(instance_id)


def kv_tokens(inst: Instance) -> int:
    """The KV an instance holds, in tokens (its reported block pool)."""
    return inst.load.total_blocks * inst.block_size


class LengthRouted(PlacementPolicy):
    """Decode placement by predicted length, for a decode pool of mixed memory: a request
    predicted (p50) to run `long_tokens` or more goes to the decodes with the most KV (the
    largest reported block pool: a long answer holds and grows its KV longest), the others to
    the rest; within each group the inner policy chooses. When the group has no room for the
    prompt now and the other group has, the other one is used (no wait for blocks). A pool
    of one memory size is placed as the inner policy places it. Prefill: the inner policy's."""

    def __init__(self, inner: PlacementPolicy, long_tokens: int = 256) -> None:
        self.inner = inner
        self.long_tokens = long_tokens
        self.name = f"{inner.name}+length"

    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        most = max(kv_tokens(i) for i in candidates)
        big = [i for i in candidates if kv_tokens(i) == most]
        small = [i for i in candidates if kv_tokens(i) < most]
        if not small:
            return self.inner.pick_decode(request, candidates)
        long = request.predicted_tokens >= self.long_tokens
        first, other = (big, small) if long else (small, big)
        need = len(request.token_ids) + 1

        def room(group: Sequence[Instance]) -> bool:
            return any(i.load.free_blocks * i.block_size >= need for i in group)

        group = other if not room(first) and room(other) else first
        return self.inner.pick_decode(request, group)

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return self.inner.pick_prefill(request, candidates)

    def on_routed(
        self, request: RouteRequest, prefill: Instance | None, decode: Instance | None
    ) -> None:
        self.inner.on_routed(request, prefill, decode)

    def forget(self, instance_id: str) -> None:
        self.inner.forget(instance_id)


def with_decode_placement(
    policy: PlacementPolicy,
    decode_placement: str,
    demand: DecodeDemand | None = None,
    length_routing_tokens: int = 256,
) -> PlacementPolicy:
    """`policy` with the named decode placement ("count": unchanged)."""
    if decode_placement == "predicted":
        return PredictedFootprint(policy, demand if demand is not None else DecodeDemand())
    if decode_placement == "length":
        return LengthRouted(policy, length_routing_tokens)
    if decode_placement != "count":
        raise ValueError(
            f"unknown decode placement {decode_placement!r}; choose one of {DECODE_PLACEMENTS}"
        )
    return policy
