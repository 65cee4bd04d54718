"""Prefill role: compute a prompt's KV and push it, layer by layer, to a decode instance.

The engine calls `kv_sink(layer, kv)` on its thread right after layer `layer` of the request's
last prompt chunk is computed; the sink hands the tensor to the event loop, which starts the
UCX send at once, so the transfer of layer l overlaps the compute of layer l+1.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.errors import (
    DeadlineError,
    FailedPreconditionError,
    InvalidRequestError,
    UnavailableError,
)
from pdserve.kv.transfer import TransferFailedError, UcxTransport
from pdserve.logging import get_logger
from pdserve.worker.domain import StageCosts, Ticket
from pdserve.worker.kv_reuse import KVReuse
from pdserve.worker.nonce import token_message

_log = get_logger(__name__)


class LayerPusher:
    """Collects the per-layer sends of one request (event-loop side). Every send task it
    starts is awaited by `wait` or retired by `close`; a layer the engine hands over after
    `close` (the sink runs on the engine thread) is dropped, never sent unawaited."""

    def __init__(
        self, transport: UcxTransport, ticket: Ticket, timeout_s: float, link: Any = None
    ) -> None:
        self._transport = transport
        self._link = link  # emulate.link.EmulatedLink: the modelled transfer time (emulation)
        self._ticket = ticket
        self._timeout_s = timeout_s
        self._sends: list[asyncio.Task] = []
        self._closed = False
        self.bytes = 0

    def sink(self, loop: asyncio.AbstractEventLoop):
        """The engine-thread callback: kv [n_blocks, 2, bs, kvh, hd] (a private copy)."""

        def kv_sink(layer: int, kv: Any) -> None:
            loop.call_soon_threadsafe(self._start, layer, kv)

        return kv_sink

    def _start(self, layer: int, kv: Any, count_bytes: bool = True) -> None:
        if self._closed:
            return
        if count_bytes:
            self.bytes += kv.nbytes
        tag = self._ticket.tag_base + layer
        addr = self._ticket.ucx_worker_address
        send = self._transport.send(addr, tag, kv, self._timeout_s)
        if self._link is not None and count_bytes:
            send = self._link.after(kv.nbytes, send)
        task = asyncio.ensure_future(send)
        task.add_done_callback(_retrieve)
        self._sends.append(task)

    def push_token(self, token: int, num_layers: int) -> None:
        """Token 0 follows the layers (tag tag_base + num_layers): int32 token, then the
        ticket's nonce (the decode admits the KV only if it matches)."""
        self._start(num_layers, token_message(token, self._ticket.nonce), count_bytes=False)

    async def finish(self, first_token: int | None, num_layers: int) -> None:
        """After the last layer: send token 0 when the ticket asks for early admission, then
        wait until every send completed."""
        expected = num_layers
        if self._ticket.early_admission and first_token is not None:
            self.push_token(first_token, num_layers)
            expected += 1
        await self.wait(expected)

    async def wait(self, expected_layers: int) -> None:
        if len(self._sends) != expected_layers:
            raise UnavailableError(
                f"pushed {len(self._sends)} of {expected_layers} KV layers to the decode"
            )
        results = await asyncio.gather(*self._sends, return_exceptions=True)
        for result in results:
            if isinstance(result, TransferFailedError):
                # DEADLINE_EXCEEDED, not UNAVAILABLE: the decode side failed (gone, or its
                # lease ran out), not this worker, so the router must not mark us suspect.
                raise DeadlineError(f"KV transfer to decode failed: {result}") from result
            if isinstance(result, BaseException):
                raise result

    def close(self) -> None:
        """Stop: cancel the sends still running and drop layers that arrive later."""
        self._closed = True
        for send in self._sends:
            send.cancel()


def _retrieve(task: asyncio.Task) -> None:
    """Mark a send's failure as seen (`wait` reports it when someone waits)."""
    if not task.cancelled() and task.exception() is not None:
        _log.debug("kv send failed", error=repr(task.exception()))


class PrefillHandler:
    def __init__(
        self,
        engine: AsyncEngine,
        transport: UcxTransport,
        kv_reuse: KVReuse,
        transfer_timeout_s: float,
        link: Any = None,
    ) -> None:
        self._engine = engine
        self._link = link
        self._transport = transport
        self._kv_reuse = kv_reuse
        self._spec = engine.spec
        self._kv_fingerprint = engine.kv_fingerprint
        self._timeout_s = transfer_timeout_s

    async def prefill(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        ticket: Ticket | None,
        use_kvstore: bool,
    ) -> tuple[int, StageCosts]:
        """Returns (token 0, stage costs) once every layer has reached the decode. Without a
        ticket (a 1-token request: nothing to decode) the KV stays here."""
        if ticket is not None:
            self._check_ticket(token_ids, ticket)
        started = time.perf_counter()
        stages = StageCosts()
        pusher = (
            LayerPusher(self._transport, ticket, self._timeout_s, self._link) if ticket else None
        )
        use_kvstore = use_kvstore and self._kv_reuse.enabled
        try:
            if use_kvstore:
                stages.kvstore_tokens = await self._kv_reuse.fetch_prefix(
                    request_id, token_ids, hold_finished=True
                )
            first_token = await self._compute(request_id, token_ids, params, pusher, stages)
            computed = time.perf_counter()
            if pusher is not None:
                await pusher.finish(first_token, self._spec.num_layers)
        except BaseException:
            if pusher is not None:
                pusher.close()
            self._engine.abort_nowait(request_id)  # idempotent; releases its holds too
            raise
        done = time.perf_counter()
        if first_token is None:
            raise UnavailableError(f"prefill of {request_id} produced no token")
        stages.prefill_ms = (computed - started) * 1e3
        # exposed transfer only: the sends of layers 0..L-2 overlap the compute of later layers
        stages.transfer_ms = (done - computed) * 1e3
        stages.transfer_bytes = pusher.bytes if pusher is not None else 0
        if use_kvstore:
            self._kv_reuse.publish_later(request_id, token_ids)
        return first_token, stages

    async def _compute(
        self,
        request_id: str,
        token_ids: Sequence[int],
        params: SamplingParams,
        pusher: LayerPusher | None,
        stages: StageCosts,
    ) -> int | None:
        """Run the prompt (prefill only); each layer's KV goes to `pusher` (if any) as it is
        computed. Returns token 0."""
        sink = pusher.sink(asyncio.get_running_loop()) if pusher is not None else None
        first_token = None
        outputs = self._engine.generate(
            request_id, token_ids, params, prefill_only=True, kv_sink=sink
        )
        async for out in outputs:
            if out.new_token_ids:
                first_token = out.new_token_ids[0]
                stages.cached_tokens = out.num_cached_tokens
            if out.finish_reason == "abort":
                raise asyncio.CancelledError(f"request {request_id} aborted")
        return first_token

    def _check_ticket(self, token_ids: Sequence[int], ticket: Ticket) -> None:
        if ticket.kv_fingerprint != self._kv_fingerprint:
            raise FailedPreconditionError(
                "ticket.kv_fingerprint: the decode instance runs a different model or KV "
                f"layout ({ticket.kv_fingerprint[:16]} != {self._kv_fingerprint[:16]})"
            )
        need = self._spec.num_blocks_for(len(token_ids))
        if ticket.num_blocks != need:
            raise InvalidRequestError(
                "ticket.num_blocks", f"is {ticket.num_blocks}, the prompt needs {need} blocks"
            )
        if ticket.lease_expiry_unix_s and ticket.lease_expiry_unix_s < time.time():
            raise UnavailableError("ticket lease already expired")
