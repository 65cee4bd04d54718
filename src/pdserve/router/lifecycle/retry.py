"""`Tries`: the one retry rule of the orchestrator's four loops (reserve on a decode, prefill
with a ticket, prefill only, colocated Generate), with one error vocabulary.

A loop picks an instance it has not tried (`pick`), calls it, and on a failure asks
`failed(failure, attempts)`: return to try another, or raise. It raises
- the failure itself when another instance would not help (not UNAVAILABLE,
  DEADLINE_EXCEEDED or RESOURCE_EXHAUSTED: bad input, a worker bug);
- UnavailableError("<step> failed on N instance(s); last: <failure>") when no untried
  instance is left or `max_attempts` attempts were made;
and `pick` raises UnavailableError("no <step> instance is available (tried N)") when none
is left to pick. <step> is the role's name (decode, prefill, colocated), so a colocated
request never reads "prefill failed".
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.errors import UnavailableError

from ..cluster.registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, Instance, Registry
from ..cluster.workers import RETRYABLE

ROLE_KINDS = {ROLE_PREFILL: "prefill", ROLE_DECODE: "decode", ROLE_COLOCATED: "colocated"}


class Tries:
    def __init__(self, registry: Registry, role: int, max_attempts: int = 0) -> None:
        self.registry, self.role = registry, role
        self.step = ROLE_KINDS[role]
        self.max_attempts = max_attempts  # 0 = as many as there are instances
        self.tried: set[str] = set()

    def _left(self) -> list[Instance]:
        return [c for c in self.registry.candidates(self.role) if c.instance_id not in self.tried]

    def pick(self, choose: Callable[[list[Instance]], Instance]) -> Instance:
        """An untried live instance, chosen by `choose` (the placement policy)."""
        cands = self._left()
        if not cands:
            more = f" (tried {len(self.tried)})" if self.tried else ""
            raise UnavailableError(f"no {self.step} instance is available{more}")
        inst = choose(cands)
        self.tried.add(inst.instance_id)
        return inst

    def forget(self, inst: Instance) -> None:
        """`inst` may be picked again (its failure was another instance's fault)."""
        self.tried.discard(inst.instance_id)

    def reset(self) -> None:
        """Every instance may be picked again (after waiting for capacity)."""
        self.tried.clear()

    def failed(self, failure: BaseException, attempts: int = 0) -> None:
        """After `failure` (the `attempts`-th): return when another try may run, else raise."""
        if getattr(failure, "code", None) not in RETRYABLE:
            raise failure
        if not self._left() or (self.max_attempts and attempts >= self.max_attempts):
            raise UnavailableError(
                f"{self.step} failed on {len(self.tried)} instance(s); last: {failure}"
            ) from None
