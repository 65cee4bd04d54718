"""Decode placements wrapped around a placement policy (`factory.make_policy`): the inner
policy places prefills (and colocated requests); these choose the decode instance from the
request's predicted length.

- `PredictedFootprint` ("predicted"): least predicted KV footprint and batch over the
  request's predicted lifetime.
- `LengthRouted` ("length"): for a decode pool of mixed memory, answers predicted long go to
  the decodes with the most KV, the others to the rest.
"""

from __future__ import annotations

from collections import deque
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
    """Decode placement by predicted length, for a decode pool of mixed memory: long answers
    go to the decodes with the most KV (the largest reported block pool: a long answer holds
    and grows its KV longest), short ones to the rest; within each group the inner policy
    chooses. A pool of one memory size is placed as the inner policy places it.

    What is long: with `long_tokens` > 0, a prediction (p50) of that many tokens or more.
    With 0 (adaptive), the longest share f of requests, f = the big decodes' share of the
    pool's KV, ranked among the last `window` predictions: a prediction at or above the
    (1 - f) quantile is long, below it short, and one tied across the cut (a predictor with
    nothing to tell them apart) is placed over the whole pool, as is everything until
    `min_samples` predictions were seen. A predictor still learning drifts (each prediction
    above the older ones it is ranked against), so the split is also held to the share: when
    more than f + `slack` of the last `window` requests placed by length went to the big
    decodes, a long one goes to the others (and the reverse). So a predictor that ranks
    badly cannot send the whole load to one group. When the chosen group has no room for the
    prompt now and the other has, the other is used (no wait for blocks). Prefill: the inner
    policy's."""

    def __init__(self, inner: PlacementPolicy, long_tokens: int = 0, window: int = 512,
                 min_samples: int = 32, slack: float = 0.1) -> None:  # fmt: skip
        self.inner = inner
        self.long_tokens = long_tokens
        self.min_samples = min_samples
        self.slack = slack
        self._recent: deque[int] = deque(maxlen=window)
        self._sent_big: deque[bool] = deque(maxlen=window)  # the adaptive cut's decisions
        self.name = f"{inner.name}+length"

    def is_long(self, predicted: int, big_share: float) -> bool | None:
        """True (big decodes), False (the others) or None (the whole pool)."""
        if self.long_tokens > 0:
            return predicted >= self.long_tokens
        n = len(self._recent)
        if n < self.min_samples:
            return None
        below = sum(1 for x in self._recent if x < predicted) / n
        at_most = sum(1 for x in self._recent if x <= predicted) / n
        cut = 1.0 - big_share
        return True if below >= cut else False if at_most <= cut else None

    def held_to_share(self, long: bool, big_share: float) -> bool:
        """The adaptive cut's decision, turned over when the last decisions sent the big
        decodes more (or less) than their share by over `slack`; recorded."""
        if len(self._sent_big) >= self.min_samples:
            sent = sum(self._sent_big) / len(self._sent_big)
            if long and sent > big_share + self.slack:
                long = False
            elif not long and sent < big_share - self.slack:
                long = True
        self._sent_big.append(long)
        return long

    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        most = max(kv_tokens(i) for i in candidates)
        big = [i for i in candidates if kv_tokens(i) == most]
        small = [i for i in candidates if kv_tokens(i) < most]
        share = sum(kv_tokens(i) for i in big) / max(1, sum(kv_tokens(i) for i in candidates))
        long = None if not small else self.is_long(request.predicted_tokens, share)
        if long is None:
            return self.inner.pick_decode(request, candidates)
        if self.long_tokens <= 0:
            long = self.held_to_share(long, share)
        first, other = (big, small) if long else (small, big)
        need = len(request.token_ids) + 1

        def room(group: Sequence[Instance]) -> bool:
            return any(i.load.free_blocks * i.block_size >= need for i in group)

        group = other if not room(first) and room(other) else first
        return self.inner.pick_decode(request, group)

    def on_routed(
        self, request: RouteRequest, prefill: Instance | None, decode: Instance | None
    ) -> None:
        if decode is not None:
            self._recent.append(request.predicted_tokens)
        self.inner.on_routed(request, prefill, decode)

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return self.inner.pick_prefill(request, candidates)

    def forget(self, instance_id: str) -> None:
        self.inner.forget(instance_id)


def with_decode_placement(
    policy: PlacementPolicy,
    decode_placement: str,
    demand: DecodeDemand | None = None,
    length_routing_tokens: int = 0,
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
