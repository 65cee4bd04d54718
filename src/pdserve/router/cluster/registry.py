"""Registry of worker instances: register, heartbeat, expiry, suspicion.

Pure bookkeeping (no gRPC, no asyncio). The clock is injected so expiry is
testable with a fake clock. Invariants:
- every live instance shares `model_fingerprint` (set by the first registration,
  cleared when the registry becomes empty);
- an instance is a routing candidate iff state == "serving", it is not
  suspect, and its last heartbeat is younger than `heartbeat_timeout_s`.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.errors import FailedPreconditionError, InvalidRequestError
from pdserve.load import LoadReport

__all__ = ["LoadReport", "Registry"]
_EXPIRED_KEPT = 1024  # expired instance ids remembered (for Registry.lost)  # LoadReport: the shared heartbeat load, re-exported


class Role(enum.IntEnum):
    """A worker's role (the wire's WorkerRole numbers)."""

    PREFILL = 1
    DECODE = 2
    COLOCATED = 3


ROLE_PREFILL, ROLE_DECODE, ROLE_COLOCATED = Role.PREFILL, Role.DECODE, Role.COLOCATED


class State(enum.StrEnum):
    """An instance's state: the worker's (heartbeats), or `FLIPPING` set by the router."""

    STARTING = "starting"
    SERVING = "serving"
    DRAINING = "draining"
    FLIPPING = "flipping"


ROLE_NAMES = {
    0: "unspecified",
    ROLE_PREFILL: "prefill",
    ROLE_DECODE: "decode",
    ROLE_COLOCATED: "colocated",
}


@dataclass
class Instance:
    instance_id: str
    address: str
    role: Role
    model_fingerprint: str
    block_size: int
    load: LoadReport
    last_heartbeat: float
    state: State = State.SERVING
    suspect_since: float | None = None
    # Router-side counters: exact and current, unlike the heartbeat's load.
    inflight_requests: int = 0
    inflight_tokens: int = 0
    dtype: str = ""  # what it serves, resolved ("" from a worker that does not say)
    kernels: str = ""  # what its forward pass runs (KernelSelection.summary; "" unknown)

    @property
    def role_name(self) -> str:
        return ROLE_NAMES.get(self.role, str(self.role))


class Registry:
    def __init__(
        self,
        heartbeat_timeout_s: float = 3.0,
        suspect_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.suspect_s = suspect_s  # a suspect instance stays skipped at least this long
        self._clock = clock
        self._instances: dict[str, Instance] = {}
        self.model_fingerprint: str | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._watchers: list[Callable[[], None]] = []  # on_change
        self._expired: OrderedDict[str, None] = OrderedDict()  # recent expiries, bounded

    # -- worker-facing -----------------------------------------------------
    def register(
        self,
        instance_id: str,
        address: str,
        role: int,
        model_fingerprint: str,
        block_size: int,
        load: LoadReport | None = None,
        dtype: str = "",
        kernels: str = "",
    ) -> Instance:
        if not instance_id:
            raise InvalidRequestError("instance_id", "must not be empty")
        if not address:
            raise InvalidRequestError("address", "must be host:port")
        if role not in (ROLE_PREFILL, ROLE_DECODE, ROLE_COLOCATED):
            raise InvalidRequestError("role", "must be prefill, decode or colocated")
        others = [i for i in self._instances.values() if i.instance_id != instance_id]
        if others and self.model_fingerprint and model_fingerprint != self.model_fingerprint:
            raise FailedPreconditionError(
                f"model fingerprint {model_fingerprint!r} differs from the cluster's "
                f"{self.model_fingerprint!r}: every instance must serve the same model"
            )
        if not others:
            self.model_fingerprint = model_fingerprint
        inst = Instance(
            instance_id=instance_id,
            address=address,
            role=Role(role),
            model_fingerprint=model_fingerprint,
            block_size=block_size,
            load=load or LoadReport(),
            last_heartbeat=self._clock(),
            dtype=dtype,
            kernels=kernels,
        )
        old = self._instances.get(instance_id)
        if old is not None:  # re-registration (e.g. after a role flip) keeps router counters
            inst.inflight_requests, inst.inflight_tokens = (
                old.inflight_requests,
                old.inflight_tokens,
            )
        self._instances[instance_id] = inst
        self._changed()
        return inst

    def heartbeat(self, instance_id: str, role: int, state: str, load: LoadReport) -> bool:
        """Returns False for an unknown instance: it must register again."""
        inst = self._instances.get(instance_id)
        if inst is None:
            return False
        now = self._clock()
        inst.last_heartbeat = now
        inst.load = load
        if role in (ROLE_PREFILL, ROLE_DECODE, ROLE_COLOCATED):
            inst.role = Role(role)
        if state:
            inst.state = State(state)
        if inst.suspect_since is not None and now - inst.suspect_since >= self.suspect_s:
            inst.suspect_since = None  # alive again: it heartbeats after the suspicion window
        self._changed()
        return True

    def seen(self, instance_id: str) -> None:
        """Traffic from the instance (a stream's message, an RPC's answer): it is alive, as
        a heartbeat says. A busy worker's heartbeat can lag behind the tokens it sends; a
        worker that sends them is not lost. (The load and the suspicion move only with
        heartbeats.)"""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.last_heartbeat = self._clock()

    def deregister(self, instance_id: str) -> bool:
        removed = self._instances.pop(instance_id, None) is not None
        if removed:
            self._forgotten(instance_id)
        return removed

    # -- router-facing -----------------------------------------------------
    def mark_suspect(self, instance_id: str) -> None:
        """An RPC to it failed with UNAVAILABLE: skip it until it heartbeats again."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.suspect_since = self._clock()

    def expire(self) -> list[str]:
        """Drop instances whose last heartbeat is older than the timeout."""
        now = self._clock()
        dead = [
            i.instance_id
            for i in self._instances.values()
            if now - i.last_heartbeat > self.heartbeat_timeout_s
        ]
        for iid in dead:
            del self._instances[iid]
            self._expired[iid] = None
            if len(self._expired) > _EXPIRED_KEPT:
                self._expired.popitem(last=False)
            self._forgotten(iid)
        return dead

    def lost(self, instance_id: str) -> bool:
        """The instance died as far as the router can tell: it expired, or it has not
        heartbeated for the timeout. (Suspicion alone is not enough: one failed RPC. A
        graceful deregistration is not either: a draining worker finishes its streams.)"""
        inst = self._instances.get(instance_id)
        if inst is None:
            return instance_id in self._expired
        return self._clock() - inst.last_heartbeat > self.heartbeat_timeout_s

    def serving(self, role: int) -> bool:
        """Whether `candidates(role)` is not empty (without sorting them)."""
        now = self._clock()
        return any(
            i.role == role
            and i.state == "serving"
            and i.suspect_since is None
            and now - i.last_heartbeat <= self.heartbeat_timeout_s
            for i in self._instances.values()
        )

    def candidates(self, role: int) -> list[Instance]:
        now = self._clock()
        return sorted(
            (
                i
                for i in self._instances.values()
                if i.role == role
                and i.state == "serving"
                and i.suspect_since is None
                and now - i.last_heartbeat <= self.heartbeat_timeout_s
            ),
            key=lambda i: i.instance_id,
        )

    def charge(
        self, instance_id: str, requests: int = 0, tokens: int = 0, notify: bool = True
    ) -> None:
        """Adjust the router-side in-flight counters (negative to release); the
        instance may have re-registered meanwhile, so look it up by id. `notify=False`:
        the release frees no room (a reservation the worker refused), so it must not
        wake the capacity waiters."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            inst.inflight_requests = max(0, inst.inflight_requests + requests)
            inst.inflight_tokens = max(0, inst.inflight_tokens + tokens)
            if requests < 0 and notify:  # a request left it: room may have freed there
                self._changed()

    def get(self, instance_id: str) -> Instance | None:
        return self._instances.get(instance_id)

    def instances(self) -> list[Instance]:
        return sorted(self._instances.values(), key=lambda i: i.instance_id)

    def heartbeat_age(self, inst: Instance) -> float:
        return max(0.0, self._clock() - inst.last_heartbeat)

    def on_forget(self, fn: Callable[[str], None]) -> None:
        """Call fn(instance_id) when an instance leaves (policies drop their state)."""
        self._listeners.append(fn)

    def on_change(self, fn: Callable[[], None]) -> None:
        """Call fn() after any change that may free capacity: an instance registered,
        heartbeated (new load), left, or a request left an instance."""
        self._watchers.append(fn)

    def _changed(self) -> None:
        for fn in self._watchers:
            fn()

    def _forgotten(self, instance_id: str) -> None:
        if not self._instances:
            self.model_fingerprint = None
        for fn in self._listeners:
            fn(instance_id)
        self._changed()
