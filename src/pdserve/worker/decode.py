"""Decode role: one Decode stream per request reserves KV blocks, sends the ticket, receives
the KV and token 0 over UCX, admits the request to the continuous batch the moment they land,
and streams its tokens after token 0.

Lifecycle of a reservation (one per ticket, owned by its Decode stream):
    reserve  -> blocks reserved in the engine under the request id; one UCX receive posted per
                layer (tag_base + l) and one for token 0 (tag_base + num_layers); a pump task;
                the stream sends the ticket
    admit    -> everything arrived (bounded by the lease): the pump writes the KV into the
                blocks and admits the request in one engine command (the blocks become the
                sequence's own), then queues its tokens, which the stream relays
    release  -> abort, the stream left, lease expiry or a failed transfer: cancel the
                receives, release the request's blocks in the engine (idempotent, by request id)
Invariants: the engine owns the blocks (by request id), so a cancelled stream or a lost handler
state can never leak them: `abort(request_id)` always frees them. A reservation is counted
(num_reserved) until it is released, or admitted with its stream attached.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.errors import (
    InvalidRequestError,
    OverloadedError,
    UnavailableError,
)
from pdserve.kv.transfer import RecvHandle, TransferFailedError, TransferTimeoutError, UcxTransport
from pdserve.logging import get_logger
from pdserve.worker.domain import StageCosts, Ticket, TokenEvent
from pdserve.worker.kv_reuse import KVReuse
from pdserve.worker.nonce import new_nonce, nonce_matches, token_buffer

_log = get_logger(__name__)
ID_MEMORY = 4096  # request ids remembered: Reserves seen, Aborts that came before any


def _remember(ids: collections.OrderedDict[str, None], request_id: str) -> None:
    ids[request_id] = None
    ids.move_to_end(request_id)
    if len(ids) > ID_MEMORY:
        ids.popitem(last=False)


class ResState(enum.Enum):
    RECEIVING = "receiving"  # waiting for KV + token 0
    ADMITTED = "admitted"  # running in the engine; its tokens queue until Decode attaches
    RELEASED = "released"  # aborted, expired or failed; blocks released


@dataclass(eq=False)
class Reservation:
    request_id: str
    ticket: Ticket
    prompt_token_ids: list[int]
    params: SamplingParams
    staging: list[Any]  # per stored layer [n_blocks, 2, bs, kvh_l, hd_l]: one receive each
    token_buf: np.ndarray  # int32[5]: token 0 + the ticket nonce, sent by the prefill
    handles: list[RecvHandle]  # the layers, then token 0
    created: float
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # TokenEvent | exc | None
    state: ResState = ResState.RECEIVING
    attached: bool = False  # its Decode stream relays it (after sending the ticket)
    abandoned: bool = False  # that stream left before the request finished
    expiry_timer: asyncio.TimerHandle | None = None
    pump: asyncio.Task | None = None
    last_layer_at: float | None = None
    stages: StageCosts = field(default_factory=StageCosts)
    admitted_at: float = 0.0

    @property
    def lease_alive(self) -> bool:
        return self.ticket.lease_expiry_unix_s > time.time()


class DecodeHandler:
    def __init__(
        self,
        engine: AsyncEngine,
        transport: UcxTransport,
        kv_reuse: KVReuse,
        instance_id: str,
        default_lease_s: float,
    ) -> None:
        self._engine = engine
        self._transport = transport
        self._kv_reuse = kv_reuse  # when enabled: finished blocks are kept for the write-back
        self._spec = engine.spec
        self._kv_fingerprint = engine.kv_fingerprint
        self._instance_id = instance_id
        self._default_lease_s = default_lease_s
        self._by_ticket: dict[int, Reservation] = {}
        self._by_request: dict[str, int] = {}
        self._background: set[asyncio.Task] = set()
        self._reserving: dict[str, bool] = {}  # request id -> aborted while Reserve was in flight
        # An Abort can overtake its own Reserve (another HTTP/2 stream, or both queued behind
        # a frozen process). Ids aborted before any Reserve for them was seen are remembered,
        # and the Reserve that comes later is refused instead of holding blocks until its
        # lease ends. An id seen before (e.g. a Reserve refused for want of blocks, which the
        # router aborts and retries later) is not: its next Reserve is a legitimate retry.
        # Both memories are bounded.
        self._reserve_seen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._aborted_unseen: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.counters: dict[str, float] = dict.fromkeys(
            ("reservations", "reservations_refused", "leases_expired", "transfers_failed", "admitted",
             "admission_delay_ms_sum", "kv_wait_ms_sum", "nonce_mismatch"), 0.0
        )  # fmt: skip

    @property
    def num_reserved(self) -> int:
        """Reservations waiting for their KV."""
        return len(self._by_ticket)

    @property
    def num_live_reservations(self) -> int:
        """Those whose lease still runs (a drain waits for these only)."""
        return sum(1 for r in self._by_ticket.values() if r.lease_alive)

    # ------------------------------------------------------------------ reserve
    async def reserve(
        self,
        request_id: str,
        num_prompt_tokens: int,
        lease_s: float | None,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None,
        num_predicted_tokens: int = 0,
    ) -> Ticket:
        """`num_predicted_tokens`: the router's (bounded) output-length headroom; the
        reservation holds those blocks too when they are free (best effort: without
        them, the sequence grows or is preempted as it decodes, with exact tokens)."""
        if num_prompt_tokens < 1:
            raise InvalidRequestError("num_prompt_tokens", "must be at least 1")
        if len(prompt_token_ids) != num_prompt_tokens:
            raise InvalidRequestError(
                "prompt_token_ids", "required with Reserve; length must equal num_prompt_tokens"
            )
        if params is None:
            raise InvalidRequestError("sampling", "required with Reserve")
        if request_id in self._by_request or request_id in self._reserving:
            raise InvalidRequestError("request_id", f"{request_id!r} already has a reservation")
        _remember(self._reserve_seen, request_id)
        if request_id in self._aborted_unseen:
            del self._aborted_unseen[request_id]
            raise UnavailableError(f"request {request_id} was aborted before its Reserve")
        lease_s = lease_s or self._default_lease_s
        self._reserving[request_id] = False
        try:
            # +1: the block table must also hold token 0, which the decode computes first.
            # Cancel-safe: a cancelled reserve releases what the engine reserved.
            try:
                await self._engine.reserve(
                    request_id,
                    num_prompt_tokens + 1 + max(0, num_predicted_tokens),
                    num_prompt_tokens,  # the KV that arrives: a window group reserves its window
                )
            except OverloadedError:
                if num_predicted_tokens <= 0:
                    raise
                await self._engine.reserve(request_id, num_prompt_tokens + 1, num_prompt_tokens)
        except OverloadedError:  # no room now: the router waits and retries
            self.counters["reservations_refused"] += 1
            raise
        finally:
            aborted = self._reserving.pop(request_id)
        if aborted:  # Abort(request_id) came while the engine was reserving
            await self._engine.release(request_id)
            raise UnavailableError(f"request {request_id} was aborted during Reserve")
        res = self._open(request_id, list(prompt_token_ids), params, lease_s)
        self.counters["reservations"] += 1
        return res.ticket

    def _open(
        self, request_id: str, prompt: list[int], params: SamplingParams, lease_s: float
    ) -> Reservation:
        """Post the receives, start the pump and the lease timer (no await: atomic)."""
        spec = self._spec
        n = spec.num_blocks_for(len(prompt))
        staging = [  # sliding layers receive their last window only
            self._engine.empty_kv(
                (n - spec.first_needed_block(i, len(prompt)), *spec.layer_block_shape(i))
            )
            for i in range(spec.num_layers)
        ]
        token_buf = token_buffer()
        tag_base = self._transport.new_tag_base()
        handles = [
            self._transport.post_recv(staging[i], tag_base + i) for i in range(spec.num_layers)
        ]
        handles.append(self._transport.post_recv(token_buf, tag_base + spec.num_layers))
        ticket = Ticket(
            ticket_id=tag_base,
            decode_instance_id=self._instance_id,
            ucx_worker_address=self._transport.address,
            tag_base=tag_base,
            lease_expiry_unix_s=time.time() + lease_s,
            num_blocks=n,
            kv_fingerprint=self._kv_fingerprint,
            nonce=new_nonce(),
        )
        res = Reservation(
            request_id, ticket, prompt, params, staging, token_buf, handles, time.perf_counter()
        )
        handles[spec.num_layers - 1].task.add_done_callback(
            lambda _t: setattr(res, "last_layer_at", time.perf_counter())
        )
        loop = asyncio.get_running_loop()
        res.expiry_timer = loop.call_later(lease_s, self._on_lease_expired, res)
        self._by_ticket[ticket.ticket_id] = res
        self._by_request[request_id] = ticket.ticket_id
        res.pump = asyncio.ensure_future(self._pump(res))
        return res

    # ------------------------------------------------------------------ pump
    async def _pump(self, res: Reservation) -> None:
        """Wait for KV + token 0, admit, queue the tokens for the Decode call."""
        events = res.events
        try:
            await self._await_kv(res)
            if res.state is not ResState.RECEIVING:
                return  # released meanwhile
            if not nonce_matches(res.token_buf, res.ticket.nonce):
                self.counters["nonce_mismatch"] += 1
                raise UnavailableError(
                    f"KV for {res.request_id} arrived without its ticket's nonce: discarded"
                )
            first = int(res.token_buf[0])
            events.put_nowait(TokenEvent([first]))  # token 0: the stream keeps, not sends, it
            async for ev in self._admit_to_engine(res, first):
                if res.abandoned:  # its Decode call left before the sequence joined
                    self._engine.abort_nowait(res.request_id)
                events.put_nowait(ev)
        except asyncio.CancelledError:
            events.put_nowait(UnavailableError(f"request {res.request_id} was released"))
            raise
        except Exception as exc:  # the Decode call re-raises it
            if res.state is ResState.RECEIVING:
                await self._release(res)
            events.put_nowait(exc)
        finally:
            events.put_nowait(None)

    async def _admit_to_engine(self, res: Reservation, first: int) -> AsyncIterator[TokenEvent]:
        """Write the received KV into the reserved blocks and admit the request, in ONE
        engine command (the blocks become the sequence's own); then yield its tokens."""
        res.state = ResState.ADMITTED  # from here an abort goes to the engine's sequence
        if res.attached:  # its stream owns it now: no longer a reservation under a lease
            self._forget(res)
        outputs = await self._engine.admit_prefilled(
            res.request_id, res.prompt_token_ids, first, res.params, res.staging,
            hold_on_finish=self._kv_reuse.enabled,
        )  # fmt: skip
        res.admitted_at = time.perf_counter()
        self.counters["admitted"] += 1
        self.counters["kv_wait_ms_sum"] += (res.admitted_at - res.created) * 1e3
        if res.last_layer_at is not None:
            delay_ms = (res.admitted_at - res.last_layer_at) * 1e3
            self.counters["admission_delay_ms_sum"] += delay_ms
            res.stages.queue_ms = delay_ms
        async for out in outputs:
            if out.finished:
                res.stages.decode_ms = (time.perf_counter() - res.admitted_at) * 1e3
                yield TokenEvent(out.new_token_ids, out.finish_reason, res.stages)
                return
            yield TokenEvent(out.new_token_ids)

    async def _await_kv(self, res: Reservation) -> None:
        remaining = max(0.0, res.ticket.lease_expiry_unix_s - time.time())
        try:
            await asyncio.gather(*(h.wait(remaining) for h in res.handles))
        except (TransferTimeoutError, TransferFailedError) as exc:
            self.counters["transfers_failed"] += 1
            raise UnavailableError(f"KV for {res.request_id} did not arrive: {exc}") from exc

    # ------------------------------------------------------------------ decode
    async def decode(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        lease_s: float | None = None,
        num_predicted_tokens: int = 0,
        write_back: bool = False,
    ) -> AsyncIterator[Ticket | TokenEvent]:
        """The Decode stream: reserve and yield the ticket, then relay what the pump queues
        (the tokens after token 0, which came from the prefill); then publish the
        conversation's blocks to the kvstore (`write_back`) or release what the engine kept
        for that. Leaving the stream early releases the reservation or stops the sequence."""
        prompt = list(prompt_token_ids)
        ticket = await self.reserve(
            request_id, len(prompt), lease_s, prompt, params, num_predicted_tokens
        )
        res = self._by_ticket[ticket.ticket_id]
        reason: str | None = None
        generated: list[int] = []
        try:
            yield ticket
            res.attached = True  # (an unattached one, admitted, is aborted at lease expiry)
            if res.state is ResState.ADMITTED:
                self._forget(res)
            while (item := await res.events.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                if not generated:  # token 0 (the router has it from the prefill)
                    generated.extend(item.token_ids)
                    continue
                reason = item.finish_reason
                generated.extend(item.token_ids)
                yield item
        finally:
            if reason is None:  # the caller went away (or failed): stop the request
                res.abandoned = True  # in case the pump admits it only after this
                if res.state is ResState.RECEIVING:
                    self._in_background(self._release(res))
                else:
                    self._engine.abort_nowait(res.request_id)
            self._forget(res)
            publish = write_back and reason not in (None, "abort")
            self._kv_reuse.finish(res.request_id, [*res.prompt_token_ids, *generated], publish)

    def _in_background(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------------ release
    async def abort(self, request_id: str) -> bool:
        """Idempotent: frees a pending reservation at once and stops a running sequence."""
        found = False
        if request_id in self._reserving:
            self._reserving[request_id] = True
            found = True
        ticket_id = self._by_request.get(request_id)
        res = self._by_ticket.get(ticket_id) if ticket_id is not None else None
        if res is not None:
            res.abandoned = True
            await self._release(res)
            found = True
        found = await self._engine.abort(request_id) or found
        if not found and request_id not in self._reserve_seen:
            _remember(self._aborted_unseen, request_id)
        return found

    def _on_lease_expired(self, res: Reservation) -> None:
        if self._by_ticket.get(res.ticket.ticket_id) is not res:
            return  # attached or released meanwhile
        self.counters["leases_expired"] += 1
        _log.warning(
            "lease expired", request_id=res.request_id, ticket=hex(res.ticket.ticket_id),
            state=res.state.value,
        )  # fmt: skip
        res.abandoned = True
        self._forget(res)
        if res.state is ResState.ADMITTED:  # (admission forgets it first: not reached)
            self._engine.abort_nowait(res.request_id)
        else:
            self._in_background(self._release(res))

    async def _release(self, res: Reservation) -> None:
        """Stop receiving and free the request's blocks (any state; idempotent)."""
        if res.state is ResState.RELEASED:
            return
        was_receiving = res.state is ResState.RECEIVING
        res.state = ResState.RELEASED
        self._forget(res)
        self._engine.abort_nowait(res.request_id)  # frees the reservation or the sequence
        if not was_receiving:
            return
        if res.pump is not None and res.pump is not asyncio.current_task():
            res.pump.cancel()  # (if it never ran, it queues nothing: the stream hears here)
            res.events.put_nowait(UnavailableError(f"request {res.request_id} was released"))
        # (Layers that already arrived were counted as received when they did.)
        await asyncio.gather(*(h.cancel() for h in res.handles), return_exceptions=True)

    def _forget(self, res: Reservation) -> None:
        if res.expiry_timer is not None:
            res.expiry_timer.cancel()
        self._by_ticket.pop(res.ticket.ticket_id, None)
        if self._by_request.get(res.request_id) == res.ticket.ticket_id:
            del self._by_request[res.request_id]

    async def release_all(self) -> None:
        pending = list(self._by_ticket.values())
        await asyncio.gather(*(self.abort(r.request_id) for r in pending))
