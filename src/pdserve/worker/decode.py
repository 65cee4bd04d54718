"""Decode role: reserve KV blocks for an incoming request, receive its KV over UCX, then run
it in the continuous batch.

Lifecycle of a reservation (one per ticket):
    reserve  -> blocks held by the engine, one UCX receive posted per layer (tag_base + l)
    decode   -> wait for every layer (bounded by the lease), write them into the blocks,
                admit the request (its blocks now belong to the sequence), stream tokens
    release  -> on abort, lease expiry or a failed transfer: cancel the receives, free blocks
Invariant: a reservation's blocks are freed exactly once, by admission or by release.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.errors import InvalidRequestError, NotFoundError, UnavailableError
from pdserve.kv.spec import KVSpec
from pdserve.kv.transfer import RecvHandle, TransferFailedError, TransferTimeoutError, UcxTransport
from pdserve.logging import get_logger
from pdserve.worker.domain import StageCosts, Ticket, TokenEvent

_log = get_logger(__name__)


@dataclass
class Reservation:
    request_id: str
    ticket: Ticket
    block_ids: list[int]
    staging: torch.Tensor  # [L, n_blocks, 2, bs, kvh, hd]: one contiguous receive per layer
    handles: list[RecvHandle]
    created: float
    state: str = "waiting"  # waiting -> admitted | released
    expiry_timer: asyncio.TimerHandle | None = None
    last_layer_at: float | None = field(default=None)


class DecodeHandler:
    def __init__(
        self,
        engine: AsyncEngine,
        transport: UcxTransport,
        spec: KVSpec,
        kv_fingerprint: str,
        instance_id: str,
        default_lease_s: float,
    ) -> None:
        self._engine = engine
        self._transport = transport
        self._spec = spec
        self._kv_fingerprint = kv_fingerprint
        self._instance_id = instance_id
        self._default_lease_s = default_lease_s
        self._by_ticket: dict[int, Reservation] = {}
        self._by_request: dict[str, int] = {}
        self._background: set[asyncio.Task] = set()
        self.counters: dict[str, float] = dict.fromkeys(
            ("reservations", "leases_expired", "transfers_failed", "admitted",
             "admission_delay_ms_sum", "kv_wait_ms_sum"), 0.0
        )  # fmt: skip

    @property
    def num_reserved(self) -> int:
        return len(self._by_ticket)

    # ------------------------------------------------------------------ reserve
    async def reserve(
        self, request_id: str, num_prompt_tokens: int, lease_s: float | None
    ) -> Ticket:
        if num_prompt_tokens < 1:
            raise InvalidRequestError("num_prompt_tokens", "must be at least 1")
        if request_id in self._by_request:
            raise InvalidRequestError("request_id", f"{request_id!r} already has a reservation")
        lease_s = lease_s or self._default_lease_s
        engine = self._engine.engine
        # +1: the block table must also hold token 0, which the decode computes first.
        block_ids = await self._engine.call(lambda: engine.reserve_blocks(num_prompt_tokens + 1))
        n = self._spec.num_blocks_for(num_prompt_tokens)
        staging = torch.empty(
            (self._spec.num_layers, n, *self._spec.block_shape), dtype=_torch_dtype(self._spec)
        )
        tag_base = self._transport.new_tag_base()
        handles = [
            self._transport.post_recv(staging[layer], tag_base + layer)
            for layer in range(self._spec.num_layers)
        ]
        ticket = Ticket(
            ticket_id=tag_base,
            decode_instance_id=self._instance_id,
            ucx_worker_address=self._transport.address,
            tag_base=tag_base,
            lease_expiry_unix_s=time.time() + lease_s,
            num_blocks=n,
            kv_fingerprint=self._kv_fingerprint,
        )
        res = Reservation(request_id, ticket, block_ids, staging, handles, time.perf_counter())
        last = handles[-1]
        last.task.add_done_callback(lambda _t: setattr(res, "last_layer_at", time.perf_counter()))
        loop = asyncio.get_running_loop()
        res.expiry_timer = loop.call_later(lease_s, self._on_lease_expired, ticket.ticket_id)
        self._by_ticket[ticket.ticket_id] = res
        self._by_request[request_id] = ticket.ticket_id
        self.counters["reservations"] += 1
        return ticket

    # ------------------------------------------------------------------ decode
    async def decode(
        self,
        request_id: str,
        ticket_id: int,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
    ) -> AsyncIterator[TokenEvent]:
        res = self._by_ticket.get(ticket_id)
        if res is None or res.state != "waiting":
            raise NotFoundError(f"ticket {ticket_id:#x} is unknown, expired or already used")
        if res.request_id != request_id:
            raise InvalidRequestError("request_id", "does not match the ticket's request")
        if self._spec.num_blocks_for(len(prompt_token_ids)) != res.ticket.num_blocks:
            raise InvalidRequestError("prompt_token_ids", "length does not match the ticket")
        res.state = "receiving"
        started = time.perf_counter()
        try:
            await self._await_kv(res)
        except BaseException:
            await self._release(res)
            raise
        stages = StageCosts()
        stages.transfer_ms = (time.perf_counter() - started) * 1e3
        engine = self._engine.engine

        def write_all() -> None:
            for layer in range(self._spec.num_layers):
                engine.write_kv(res.block_ids, layer, res.staging[layer])

        try:
            await self._engine.call(write_all)
        except BaseException:
            await self._release(res)
            raise
        self._forget(res)
        res.state = "admitted"
        admitted_at = time.perf_counter()
        self.counters["admitted"] += 1
        self.counters["kv_wait_ms_sum"] += stages.transfer_ms
        if res.last_layer_at is not None:
            self.counters["admission_delay_ms_sum"] += (admitted_at - res.last_layer_at) * 1e3
        stream = self._engine.generate_prefilled(
            request_id, prompt_token_ids, first_token, params, res.block_ids
        )
        async for out in stream:
            if out.finished:
                stages.decode_ms = (time.perf_counter() - admitted_at) * 1e3
                yield TokenEvent(out.new_token_ids, out.finish_reason, stages)
                return
            yield TokenEvent(out.new_token_ids)

    async def _await_kv(self, res: Reservation) -> None:
        remaining = max(0.0, res.ticket.lease_expiry_unix_s - time.time())
        try:
            await asyncio.gather(*(h.wait(remaining) for h in res.handles))
        except (TransferTimeoutError, TransferFailedError) as exc:
            self.counters["transfers_failed"] += 1
            raise UnavailableError(f"KV for {res.request_id} did not arrive: {exc}") from exc

    # ------------------------------------------------------------------ release
    async def abort(self, request_id: str) -> bool:
        """Idempotent: frees a pending reservation and aborts a running sequence."""
        found = False
        ticket_id = self._by_request.get(request_id)
        if ticket_id is not None:
            res = self._by_ticket.get(ticket_id)
            if res is not None:
                await self._release(res)
                found = True
        found = await self._engine.abort(request_id) or found
        return found

    def _on_lease_expired(self, ticket_id: int) -> None:
        res = self._by_ticket.get(ticket_id)
        if res is None or res.state != "waiting":
            return  # admitted, released, or receiving (bounded by the same lease)
        self.counters["leases_expired"] += 1
        _log.warning("lease expired", request_id=res.request_id, ticket=hex(ticket_id))
        task = asyncio.ensure_future(self._release(res))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, res: Reservation) -> None:
        if res.state in ("released", "admitted"):
            return
        never_waited = res.state == "waiting"
        res.state = "released"
        self._forget(res)
        if never_waited:
            # Layers that already arrived count as received (e.g. a 1-token request: the router
            # releases the ticket right after prefill); wait(0) on a finished receive counts it.
            arrived = [h for h in res.handles if h.done]
            await asyncio.gather(*(h.wait(0) for h in arrived), return_exceptions=True)
        await asyncio.gather(*(h.cancel() for h in res.handles), return_exceptions=True)
        engine = self._engine.engine
        try:
            await self._engine.call(lambda: engine.free_blocks(res.block_ids))
        except UnavailableError:
            pass  # engine shut down: nothing left to free

    def _forget(self, res: Reservation) -> None:
        if res.expiry_timer is not None:
            res.expiry_timer.cancel()
        self._by_ticket.pop(res.ticket.ticket_id, None)
        if self._by_request.get(res.request_id) == res.ticket.ticket_id:
            del self._by_request[res.request_id]

    async def release_all(self) -> None:
        await asyncio.gather(*(self._release(r) for r in list(self._by_ticket.values())))


def _torch_dtype(spec: KVSpec) -> torch.dtype:
    return getattr(torch, spec.dtype)
