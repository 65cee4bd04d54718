"""Predicted decode demand: what the router placed on each decode instance, how
far each request got, and how long it is predicted to run.

The router sees every placement and every streamed token, so it can track each
decode instance's KV footprint over time without asking the workers:
    request j holds prompt_j + generated_j tokens now and grows by one per step
    for its predicted remaining rem_j = max(predicted_j - generated_j, tail_j)
(a request that outlived its prediction gets a tail guess, a quarter of what it
generated so far, at least `min_remaining`). Pure bookkeeping: no I/O."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass
class PlacedDemand:
    request_id: str
    instance_id: str
    prompt_tokens: int
    predicted_tokens: int
    generated: int = 0


class DecodeDemand:
    def __init__(self, min_remaining: int = 8) -> None:
        self.min_remaining = min_remaining
        self._by_request: dict[str, PlacedDemand] = {}
        self._by_instance: dict[str, dict[str, PlacedDemand]] = {}

    # -- updates
    def add(
        self, request_id: str, instance_id: str, prompt_tokens: int, predicted_tokens: int
    ) -> None:
        self.remove(request_id)
        p = PlacedDemand(request_id, instance_id, prompt_tokens, max(1, predicted_tokens))
        self._by_request[request_id] = p
        self._by_instance.setdefault(instance_id, {})[request_id] = p

    def progress(self, request_id: str, new_tokens: int) -> None:
        p = self._by_request.get(request_id)
        if p is not None:
            p.generated += new_tokens

    def remove(self, request_id: str) -> None:
        p = self._by_request.pop(request_id, None)
        if p is not None:
            placed = self._by_instance.get(p.instance_id)
            if placed is not None:
                placed.pop(request_id, None)
                if not placed:
                    del self._by_instance[p.instance_id]

    def forget(self, instance_id: str) -> None:
        for rid in list(self._by_instance.get(instance_id, {})):
            self.remove(rid)

    # -- queries
    def remaining(self, p: PlacedDemand) -> int:
        tail = max(self.min_remaining, p.generated // 4)
        return max(p.predicted_tokens - p.generated, tail)

    def placements(self, instance_id: str) -> Iterable[PlacedDemand]:
        return self._by_instance.get(instance_id, {}).values()

    def count(self, instance_id: str) -> int:
        return len(self._by_instance.get(instance_id, {}))

    def footprint(self, instance_id: str) -> int:
        """Predicted peak KV tokens: prompt + generated + predicted remaining, summed."""
        return sum(
            p.prompt_tokens + p.generated + self.remaining(p) for p in self.placements(instance_id)
        )

    def current_tokens(self, instance_id: str) -> int:
        return sum(p.prompt_tokens + p.generated for p in self.placements(instance_id))

    def overlap(self, instance_id: str, horizon: int) -> float:
        """KV token-steps the instance's current requests hold during the next `horizon`
        decode steps: sum_j of the integral over t in [0, min(rem_j, horizon)] of
        (prompt_j + generated_j + t)."""
        total = 0.0
        for p in self.placements(instance_id):
            m = min(self.remaining(p), horizon)
            total += (p.prompt_tokens + p.generated) * m + m * m / 2.0
        return total

    def predicted_remaining(self, instance_ids: Iterable[str] | None = None) -> int:
        ids = self._by_instance.keys() if instance_ids is None else instance_ids
        return sum(self.remaining(p) for i in list(ids) for p in self.placements(i))

    def __len__(self) -> int:
        return len(self._by_request)
