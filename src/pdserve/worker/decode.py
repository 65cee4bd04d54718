"""Decode role: reserve KV blocks for an incoming request, receive its KV over UCX, then run
it in the continuous batch.

Lifecycle of a reservation (one per ticket):
    reserve  -> blocks held by the engine, one UCX receive posted per layer (tag_base + l)
    admit    -> every layer arrived (bounded by the lease): write them into the blocks, admit
                the request (its blocks now belong to the sequence)
    decode   -> the Decode call streams the request's tokens
    release  -> on abort, lease expiry or a failed transfer: cancel the receives, free blocks
Early admission (Reserve carried the prompt and sampling): the prefill also sends token 0
(tag_base + num_layers) and a pump task admits the request the moment everything arrived,
queueing its tokens until the Decode call attaches; otherwise the Decode call admits it.
Invariants: a reservation's blocks are freed exactly once, by admission or by release; a
reservation stays counted (num_reserved) until its Decode call attaches or it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    UnavailableError,
)
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
    state: str = "waiting"  # waiting -> receiving -> admitted | released
    attached: bool = False  # a Decode call is streaming this request
    abandoned: bool = False  # that call left before the request finished
    expiry_timer: asyncio.TimerHandle | None = None
    last_layer_at: float | None = field(default=None)
    # early admission only
    prompt_token_ids: list[int] | None = None
    params: SamplingParams | None = None
    token_buf: np.ndarray | None = None  # int32[1]: token 0, sent by the prefill
    token_handle: RecvHandle | None = None
    events: asyncio.Queue | None = None  # TokenEvent | BaseException | None (end)
    stages: StageCosts = field(default_factory=StageCosts)
    admitted_at: float = 0.0


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
        self.hold_finished = False  # keep a finished request's blocks for the kvstore write-back
        self.counters: dict[str, float] = dict.fromkeys(
            ("reservations", "leases_expired", "transfers_failed", "admitted",
             "admission_delay_ms_sum", "kv_wait_ms_sum"), 0.0
        )  # fmt: skip

    @property
    def num_reserved(self) -> int:
        return len(self._by_ticket)

    # ------------------------------------------------------------------ reserve
    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        lease_s: float | None,
        prompt_token_ids: Sequence[int] = (),
        params: SamplingParams | None = None,
    ) -> Ticket:
        if num_prompt_tokens < 1:
            raise InvalidRequestError("num_prompt_tokens", "must be at least 1")
        early = bool(prompt_token_ids) and params is not None
        if prompt_token_ids and len(prompt_token_ids) != num_prompt_tokens:
            raise InvalidRequestError("prompt_token_ids", "length must equal num_prompt_tokens")
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
            early_admission=early,
        )
        res = Reservation(request_id, ticket, block_ids, staging, handles, time.perf_counter())
        last = handles[-1]
        last.task.add_done_callback(lambda _t: setattr(res, "last_layer_at", time.perf_counter()))
        loop = asyncio.get_running_loop()
        res.expiry_timer = loop.call_later(lease_s, self._on_lease_expired, ticket.ticket_id)
        self._by_ticket[ticket.ticket_id] = res
        self._by_request[request_id] = ticket.ticket_id
        self.counters["reservations"] += 1
        if early:
            res.prompt_token_ids, res.params = list(prompt_token_ids), params
            res.token_buf = np.zeros(1, dtype=np.int32)
            layers = self._spec.num_layers
            res.token_handle = self._transport.post_recv(res.token_buf, tag_base + layers)
            res.events = asyncio.Queue()
            res.state = "receiving"  # the pump owns it now; the lease bounds its wait
            self._spawn(self._pump(res))
        return ticket

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _pump(self, res: Reservation) -> None:
        """Early admission: wait for KV + token 0, admit, queue the tokens for Decode."""
        assert res.events is not None and res.token_handle is not None and res.params
        events = res.events
        try:
            await self._await_kv(res, extra=[res.token_handle])
            if res.state != "receiving":
                return  # released meanwhile (abort)
            first = int(res.token_buf[0]) if res.token_buf is not None else 0
            events.put_nowait(TokenEvent([first]))  # token 0, for the consistency check
            stream = self._admit(res, res.prompt_token_ids or [], first, res.params)
            async for ev in stream:
                if res.abandoned:  # its Decode call left before the sequence joined
                    await self._engine.abort(res.request_id)
                events.put_nowait(ev)
        except BaseException as exc:  # the Decode call re-raises it
            if res.state in ("waiting", "receiving"):
                await self._release(res)
            events.put_nowait(exc if isinstance(exc, Exception) else UnavailableError(str(exc)))
            if not isinstance(exc, Exception):
                raise
        finally:
            events.put_nowait(None)

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
        if res is None or res.attached or res.state == "released":
            raise NotFoundError(f"ticket {ticket_id:#x} is unknown, expired or already used")
        if res.request_id != request_id:
            raise InvalidRequestError("request_id", "does not match the ticket's request")
        if self._spec.num_blocks_for(len(prompt_token_ids)) != res.ticket.num_blocks:
            raise InvalidRequestError("prompt_token_ids", "length does not match the ticket")
        if res.events is not None:
            async for ev in self._attach(res, first_token):
                yield ev
            return
        res.state = "receiving"
        try:
            await self._await_kv(res)
        except BaseException:
            await self._release(res)
            raise
        stream = self._admit(res, prompt_token_ids, first_token, params)
        self._forget(res)
        res.attached = True
        async for ev in stream:
            yield ev

    async def _attach(self, res: Reservation, first_token: int) -> AsyncIterator[TokenEvent]:
        """The Decode call of an early-admitted request: relay what the pump queued."""
        assert res.events is not None
        self._forget(res)
        res.attached = True
        finished = False
        try:
            head = await res.events.get()
            if isinstance(head, BaseException):
                raise head
            if head is None or head.token_ids != [first_token]:
                raise FailedPreconditionError(
                    f"token 0 over UCX ({head and head.token_ids}) differs from {first_token}"
                )
            while (item := await res.events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                finished = item.finish_reason is not None
                yield item
        finally:
            if not finished:  # the caller went away (or failed): stop the sequence
                res.abandoned = True  # in case the pump admits it only after this
                await self._engine.abort(res.request_id)

    def _admit(
        self,
        res: Reservation,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams,
    ) -> AsyncIterator[TokenEvent]:
        """Every layer arrived. The returned stream, on its first iteration, writes the KV into
        the reserved blocks and admits the sequence in ONE engine command (the blocks become
        the sequence's own), then yields its tokens."""
        stages = res.stages
        kv_wait_ms = (time.perf_counter() - res.created) * 1e3  # reservation -> all KV here
        engine = self._engine.engine
        res.state = "admitted"  # from here an abort goes to the engine, not to the blocks

        def write_kv_and_count() -> None:  # engine thread
            for layer in range(self._spec.num_layers):
                engine.write_kv(res.block_ids, layer, res.staging[layer])
            if self.hold_finished:
                engine.hold_on_finish(res.request_id)
            res.admitted_at = time.perf_counter()
            self.counters["admitted"] += 1
            self.counters["kv_wait_ms_sum"] += kv_wait_ms
            if res.last_layer_at is not None:
                delay_ms = (res.admitted_at - res.last_layer_at) * 1e3
                self.counters["admission_delay_ms_sum"] += delay_ms
                stages.queue_ms = delay_ms

        outputs = self._engine.generate_prefilled(
            res.request_id, prompt_token_ids, first_token, params, res.block_ids,
            before_add=write_kv_and_count,
        )  # fmt: skip
        return self._events(res, outputs)

    async def _events(self, res: Reservation, outputs) -> AsyncIterator[TokenEvent]:
        try:
            async for out in outputs:
                if out.finished:
                    res.stages.decode_ms = (time.perf_counter() - res.admitted_at) * 1e3
                    yield TokenEvent(out.new_token_ids, out.finish_reason, res.stages)
                    return
                yield TokenEvent(out.new_token_ids)
        except Exception:
            # The admission itself may have failed (blocks still reserved): free them.
            # free_blocks ignores ids a sequence owns, so this never double-frees.
            engine = self._engine.engine
            with contextlib.suppress(UnavailableError):
                await self._engine.call(lambda: engine.free_blocks(res.block_ids))
            raise

    async def _await_kv(self, res: Reservation, extra: Sequence[RecvHandle] = ()) -> None:
        remaining = max(0.0, res.ticket.lease_expiry_unix_s - time.time())
        try:
            await asyncio.gather(*(h.wait(remaining) for h in [*res.handles, *extra]))
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
                self._forget(res)  # admitted early: the engine abort below stops it
                await self._release(res)
                found = True
        found = await self._engine.abort(request_id) or found
        return found

    def _on_lease_expired(self, ticket_id: int) -> None:
        res = self._by_ticket.get(ticket_id)
        if res is None:
            return
        if res.state == "admitted" and not res.attached:  # no Decode call came to collect it
            self.counters["leases_expired"] += 1
            _log.warning("admitted request never collected", request_id=res.request_id)
            self._forget(res)
            self._spawn(self._engine.abort(res.request_id))
            return
        if res.state != "waiting":
            return  # released, or receiving (bounded by the same lease)
        self.counters["leases_expired"] += 1
        _log.warning("lease expired", request_id=res.request_id, ticket=hex(ticket_id))
        self._spawn(self._release(res))

    async def _release(self, res: Reservation) -> None:
        if res.state in ("released", "admitted"):
            return
        never_waited = res.state == "waiting" or res.events is not None
        res.state = "released"
        self._forget(res)
        if res.token_handle is not None:
            await res.token_handle.cancel()
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
        pending = list(self._by_ticket.values())
        await asyncio.gather(*(self.abort(r.request_id) for r in pending))


def _torch_dtype(spec: KVSpec) -> torch.dtype:
    return getattr(torch, spec.dtype)
