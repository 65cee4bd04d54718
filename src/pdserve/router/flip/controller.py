"""Flip controller: move a worker between the prefill and decode pools when the load shifts.

The decision is `flip_policy.FlipPolicy` (pure). `FlipController` acts: every interval it
snapshots the registry, decides, logs the decision with its inputs, and flips: mark the instance "flipping" in the registry (placement skips it),
SetRole (the worker refuses new work, finishes what it has, switches), then set the new role
(its next heartbeat reports it too). On failure it unmarks the instance and counts a failure.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from pdserve.logging import get_logger
from pdserve.rpc.metrics import Metrics
from pdserve.v1 import worker_pb2

from ..cluster.registry import Registry, State
from ..cluster.workers import WorkerClients, remote_error, settle
from ..scheduling.demand import DecodeDemand
from .policy import FlipDecision, FlipPolicy, InstanceLoad, direction

log = get_logger("pdserve.router.flip.controller")


def snapshot(registry: Registry, demand: DecodeDemand | None = None) -> list[InstanceLoad]:
    return [
        InstanceLoad(
            instance_id=i.instance_id,
            role=i.role,
            state="suspect" if i.suspect_since is not None else i.state,
            # this router's own count, or the worker's (every replica's requests) when larger
            inflight_tokens=max(i.inflight_tokens, i.load.tokens_in_flight),
            inflight_requests=i.inflight_requests,
            num_running=i.load.num_running,
            num_reserved=i.load.num_reserved,
            free_blocks=i.load.free_blocks,
            total_blocks=i.load.total_blocks,
            block_size=i.block_size,
            predicted_kv_tokens=demand.footprint(i.instance_id) if demand is not None else 0,
        )
        for i in registry.instances()
    ]


class FlipMetrics:
    def __init__(self, metrics: Metrics) -> None:
        self.flips = metrics.counter("router_flips", "role flips completed", ["direction"])
        self.failures = metrics.counter(
            "router_flip_failures", "role flips that failed", ["direction"]
        )
        self.pressure = metrics.gauge(
            "router_flip_pressure", "pool pressure the flip controller sees (1 = full)", ["pool"]
        )
        self.in_progress = metrics.gauge("router_flip_in_progress", "1 while a flip runs")


class FlipController:
    """Runs `FlipPolicy` every `interval_s` and carries out its flips (one at a time)."""

    def __init__(
        self,
        registry: Registry,
        workers: WorkerClients,
        policy: FlipPolicy,
        metrics: FlipMetrics,
        interval_s: float = 2.0,
        set_role_timeout_s: float = 120.0,
        on_role_changed: Callable[[str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        demand: DecodeDemand | None = None,
        may_flip: Callable[[], bool] = lambda: True,
    ) -> None:
        self.registry, self.workers, self.policy = registry, workers, policy
        self.demand = demand
        self.metrics = metrics
        self.interval_s = interval_s
        self.set_role_timeout_s = set_role_timeout_s
        self._on_role_changed = on_role_changed
        self._clock = clock
        self.flipping: str | None = None  # instance id while a flip runs
        self.last_decision: FlipDecision | None = None
        # Router replicas: only the flip leader decides (replicas/leader.py). A replica that
        # takes over starts with a cooldown: the previous leader may have just flipped.
        self._may_flip = may_flip
        self._leading: bool | None = None  # None before the first tick

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop the controller for good
                log.exception("flip controller tick failed")

    async def tick(self) -> FlipDecision | None:
        """One decision (None: another replica leads the flips now)."""
        leading = self._may_flip()
        if leading and self._leading is False:
            log.info("flip leader now; cooldown first")
            self.policy.flip_ended(self._clock())
        self._leading = leading
        if not leading:
            return None
        decision = self.policy.decide(snapshot(self.registry, self.demand), self._clock())
        self.last_decision = decision
        p = decision.pressure
        self.metrics.pressure.labels("prefill").set(p.prefill)
        self.metrics.pressure.labels("decode").set(p.decode)
        quiet = decision.action == "hold" and not decision.streak
        (log.debug if quiet else log.info)("flip decision", **decision.log_fields())
        if decision.action == "flip" and self._may_flip():  # (still leading: checked again)
            await self.flip(decision.instance_id, decision.to_role)
        return decision

    async def flip(self, instance_id: str, to_role: int) -> bool:
        """Mark, SetRole (the worker drains itself), then record the new role."""
        inst = self.registry.get(instance_id)
        if inst is None:
            log.warning("flip target left the registry", instance=instance_id)
            return False
        from_role, address = inst.role, inst.address
        way = direction(from_role, to_role)
        inst.state = State.FLIPPING  # candidates() skips it from now on: it gets no new work
        self.flipping = instance_id
        self.metrics.in_progress.set(1)
        started = self._clock()
        log.info("flip started", instance=instance_id, direction=way)
        try:
            resp = await settle(
                self.workers.stub(address).SetRole(
                    worker_pb2.SetRoleRequest(role=to_role), timeout=self.set_role_timeout_s
                ),
                "SetRole",
            )
        except grpc.RpcError as err:
            failure = remote_error(err, f"instance {instance_id}")
            self._unmark(instance_id)
            self.metrics.failures.labels(way).inc()
            log.warning(
                "flip failed", instance=instance_id, direction=way, code=str(failure.code),
                error=str(failure),
            )  # fmt: skip
            return False
        finally:
            self.flipping = None
            self.metrics.in_progress.set(0)
            self.policy.flip_ended(self._clock())
        inst = self.registry.get(instance_id)
        if inst is not None:  # None: it left meanwhile (it re-registers with its new role)
            inst.role = resp.role or to_role
            if inst.state == "flipping":
                inst.state = State.SERVING
        if self._on_role_changed is not None:
            self._on_role_changed(instance_id)  # policies drop per-instance state (prefix LRU)
        self.metrics.flips.labels(way).inc()
        log.info(
            "flip done", instance=instance_id, direction=way,
            seconds=round(self._clock() - started, 3),
        )  # fmt: skip
        return True

    def _unmark(self, instance_id: str) -> None:
        inst = self.registry.get(instance_id)
        if inst is not None and inst.state == "flipping":
            inst.state = State.SERVING  # the next heartbeat reports the worker's own state
