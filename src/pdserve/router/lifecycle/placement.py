"""`RequestPlacement`: the one owner of a request's footprint on workers.

Every instance that may hold state for a request (a decode reservation, a running
prefill, a decode or colocated stream) is entered here, with the router-side
registry charges taken for it; the decode ticket lives here too. The orchestrator
moves a request between instances only through this object, and `close()` —
called once per attempt, by `Orchestrator._attempt`, however the attempt ends — uncharges and
aborts every instance still holding it. Aborts are idempotent on the workers.

Lifecycle of one holding (keyed by instance id):

    expect(inst)            an RPC that may create state on inst is about to be sent
                            (e.g. Decode: the decode may hold a reservation before
                            the router sees the ticket). Aborted on close; no charge.
    charge(inst, r, t)      add registry charges (implies expect).
    reserved(decode, t)     the Decode stream sent its ticket: keep it (the decode was charged one
                            request when picked, before the ticket, so that a burst of
                            requests spreads over the decodes instead of all picking
                            the one that looked idle).
    leave(inst, abort=...)  inst no longer holds the request: uncharge, and abort it
                            in the background unless it finished the request itself.
    await leave_now(inst)   abort and wait for it (then uncharge): used before
                            re-reserving, which may pick the same decode.
    close()                 leave(abort=True) every holding left; idempotent, never
                            awaits, so it is safe while the request is being cancelled.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from ..cluster.registry import Instance, Registry
from ..cluster.workers import Aborter
from ..job import DecodeTicket


@dataclass
class _Holding:
    instance: Instance
    requests: int = 0
    tokens: int = 0


class RequestPlacement:
    def __init__(self, request_id: str, registry: Registry, aborter: Aborter) -> None:
        self.request_id = request_id
        self._registry = registry
        self._aborter = aborter
        self._held: dict[str, _Holding] = {}
        self.decode: Instance | None = None  # the decode holding the ticket
        self.ticket: DecodeTicket | None = None
        self.closed = False

    # ------------------------------------------------------------- queries
    def holds(self, instance_id: str) -> bool:
        return instance_id in self._held

    def holding(self) -> list[str]:
        """Instance ids that may still hold the request (sorted)."""
        return sorted(self._held)

    # ------------------------------------------------------------- changes
    def expect(self, inst: Instance) -> None:
        self._check_open()
        self._held.setdefault(inst.instance_id, _Holding(inst))

    def charge(self, inst: Instance, requests: int = 1, tokens: int = 0) -> None:
        self.expect(inst)
        held = self._held[inst.instance_id]
        held.requests += requests
        held.tokens += tokens
        self._registry.charge(inst.instance_id, requests=requests, tokens=tokens)

    def reserved(self, decode: Instance, ticket: DecodeTicket) -> None:
        """The Decode stream on `decode` (charged when picked) sent `ticket`."""
        held = self._held.get(decode.instance_id)
        if held is None or held.requests < 1:
            raise RuntimeError(f"request {self.request_id}: {decode.instance_id} was not charged")
        self.decode, self.ticket = decode, ticket

    def leave(self, inst: Instance, abort: bool = True, refused: bool = False) -> None:
        """Release what this request holds on `inst` (and Abort it there, `abort`).
        `refused`: the worker refused it (RESOURCE_EXHAUSTED) and holds nothing, so no
        Abort is sent and the capacity waiters are not woken (no room freed)."""
        held = self._held.pop(inst.instance_id, None)
        if held is None:
            return
        self._uncharge(held, notify=not refused)
        if abort and not refused:
            self._aborter.later(held.instance, self.request_id)

    async def leave_now(self, inst: Instance) -> None:
        held = self._held.pop(inst.instance_id, None)
        if held is None:
            return
        try:
            await self._aborter.now(held.instance, self.request_id)
        except asyncio.CancelledError:  # cancelled mid-Abort: it must still be sent
            self._aborter.later(held.instance, self.request_id)
            raise
        finally:
            self._uncharge(held)

    def close(self) -> None:
        """Release everything still held (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        for iid in sorted(self._held):
            self.leave(self._held[iid].instance, abort=True)

    # ------------------------------------------------------------- private
    def _uncharge(self, held: _Holding, notify: bool = True) -> None:
        if held.requests or held.tokens:
            self._registry.charge(
                held.instance.instance_id,
                requests=-held.requests,
                tokens=-held.tokens,
                notify=notify,
            )
        if self.decode is not None and self.decode.instance_id == held.instance.instance_id:
            self.decode, self.ticket = None, None

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"request {self.request_id}: placement already closed")
