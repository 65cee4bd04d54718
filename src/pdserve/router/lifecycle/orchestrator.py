"""The request lifecycle across workers (docs/ARCHITECTURE.md, "Request lifecycle").

`Orchestrator.run(job)` is an async generator of `Chunk`s (token ids; the last one
carries the finish reason). Disaggregated, two worker calls per request, in three steps:

    _place_and_prefill   open the Decode stream on a decode (`_reserve`: its first message
                         is the ticket; it waits for capacity while every decode is full),
                         pick a prefill, run Prefill (the KV and token 0 are pushed to the
                         ticket's decode, which admits the request when they land) -> the
                         first token; a failed prefill releases its decode and retries.
    (yield the first token at once)
    _decode              relay the rest of the same Decode stream: the tokens after token 0.

A 1-token request (max_tokens 1) has nothing to decode: `_prefill_only` runs Prefill
without a ticket, so no decode is reserved and no KV is pushed.

Colocated: one Generate stream (`_colocated`), retried elsewhere before its first chunk.

Every instance a request touches is entered in its `RequestPlacement` (placement.py),
the one owner of its tickets and registry charges; `_attempt` (one per placement: the
request's, then one per migration) closes it exactly once however the attempt ends
(finished, failed, stop string, client cancel at any await), which aborts every instance
still holding the request.

Once per client request, not per attempt: the length prediction (`run` takes it from the
front door, which ordered the admission queue by it) and what the predictor learns.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from pdserve.engine.params import SamplingParams
from pdserve.errors import DeadlineError, OverloadedError, UnavailableError
from pdserve.logging import get_logger
from pdserve.rpc.channels import metadata_with_request_id
from pdserve.v1 import common_pb2, worker_pb2

from ..cluster.registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, Instance, Registry
from ..cluster.streams import StreamHandle
from ..cluster.workers import (
    RETRYABLE,
    Aborter,
    CallLost,
    CallTimedOut,
    RemoteError,
    WorkerClients,
    cancelled_under_us,
    remote_error,
    sampling_to_proto,
    settle,
    stages_from_proto,
    ticket_to_proto,
)
from ..job import Chunk, Deadlines, DecodeTicket, Job
from ..scheduling.admission import Capacity
from ..scheduling.length import LengthScheduling, Prediction
from ..scheduling.policies import PlacementPolicy, RouteRequest
from ..scheduling.predictor import EwmaPredictor
from .migration import Migrator, StreamLost
from .placement import RequestPlacement
from .retry import Tries
from .stream_watch import StreamWatch

log = get_logger("pdserve.router.lifecycle.orchestrator")
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


DECODE_WATCH_S = 0.25  # how often a running Prefill checks that its decode still lives


class _DecodeLost(Exception):
    """The decode holding a request's ticket died while the prefill pushed its KV."""


class Orchestrator:
    def __init__(
        self,
        registry: Registry,
        policy: PlacementPolicy,
        workers: WorkerClients,
        deadlines: Deadlines,
        *,
        eos_token_ids: Sequence[int] = (),
        max_prefill_attempts: int = 3,
        lease_s: float = 0.0,
        use_kvstore: bool = False,
        write_back: bool = False,
        hasher=None,
        length: LengthScheduling | None = None,
        max_migrations: int = 3,
        migration_wait_s: float = 10.0,
        on_migration: Callable[[str], None] | None = None,
        capacity: Capacity | None = None,
    ) -> None:
        self.registry, self.policy = registry, policy
        # Prediction, demand tracking and metrics around the lifecycle (length.py).
        self.length = length if length is not None else LengthScheduling(EwmaPredictor())
        # Wakes capacity waits (every decode full; nothing to migrate to) on cluster changes.
        if capacity is None:
            capacity = Capacity()
            registry.on_change(capacity.changed)
        self.capacity = capacity
        self.migrator = Migrator(
            self._attempt, registry, max_migrations, migration_wait_s, on_migration, capacity
        )
        self.workers, self.deadlines = workers, deadlines
        # every relayed stream's watchdog: lost instance, read deadline (stream_watch.py)
        self.streams = StreamWatch(registry, lambda: DECODE_WATCH_S)
        self.aborter = Aborter(workers, deadlines.abort_s)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_prefill_attempts = max(1, max_prefill_attempts)
        self.lease_s, self.use_kvstore, self.write_back = lease_s, use_kvstore, write_back
        self.hasher = hasher

    # -------------------------------------------------------------- public
    async def predict(self, job: Job) -> Prediction:
        """The request's output-length prediction (once per request: before admission)."""
        route = self._route(job)
        needed = self.length.is_needed()  # (asked once: it may scan the registry)
        block_size = self._predictor_block_size() if needed else 0
        return await self.length.predict(job, route, block_size, needed)

    def run(
        self, job: Job, pred: Prediction | None = None, received: Sequence[int] = ()
    ) -> AsyncIterator[Chunk]:
        """The request's chunks. When its stream breaks after the client has seen tokens,
        `Migrator` continues it on other instances (migration.py): one `_attempt` each,
        all under the request's one prediction `pred` (made here when not given).
        `received`: a resumed stream's tokens (its router died); it continues after them.
        Closing the iterator (`aclose`) closes the attempt at once (it aborts the workers)."""
        if pred is None:
            return self._predict_and_run(job, received)
        # (the Migrator's own generator: no extra level between the front door and it)
        return self.migrator.run(
            job,
            lambda part: self._attempt(part, pred),
            received,
            # the whole request's length (all attempts), learned once
            on_done=lambda finished: self.length.done(pred, len(job.output_token_ids), finished),
        )

    async def _predict_and_run(self, job: Job, received: Sequence[int]) -> AsyncIterator[Chunk]:
        gen = self.run(job, await self.predict(job), received)
        try:
            async for chunk in gen:
                yield chunk
        finally:
            await gen.aclose()

    def _route(self, job: Job) -> RouteRequest:
        return RouteRequest(
            job.request_id, job.token_ids, session_id=job.session_id, hasher=self.hasher
        )

    async def _attempt(self, job: Job, pred: Prediction) -> AsyncIterator[Chunk]:
        """One placement of `job` (a client's job, or a migration's continuation)."""
        route = self.length.route(pred, job, self._route(job))
        registry = self.registry
        if registry.serving(ROLE_PREFILL) and registry.serving(ROLE_DECODE):
            lifecycle = self._disagg
        elif registry.serving(ROLE_COLOCATED):
            lifecycle = self._colocated
        elif not registry.serving(ROLE_DECODE):
            raise UnavailableError("no decode (or colocated) instance is available")
        else:
            raise UnavailableError("no prefill instance is available")
        placement = RequestPlacement(job.request_id, self.registry, self.aborter)
        gen = lifecycle(job, route, placement, pred)
        try:
            async for chunk in gen:
                job.output_token_ids.extend(chunk.token_ids)
                self.length.progress(pred, len(chunk.token_ids))
                yield chunk
        finally:
            try:
                await gen.aclose()
            finally:
                placement.close()  # the one place a request's footprint is released
                self.length.left(pred)

    async def close(self) -> None:
        """Wait for pending background aborts."""
        await self.aborter.wait()

    # -------------------------------------------------------- disaggregated
    async def _disagg(
        self, job: Job, route: RouteRequest, placement: RequestPlacement, pred: Prediction
    ) -> AsyncIterator[Chunk]:
        if job.params.max_tokens <= 1:
            first = await self._prefill_only(job, route, placement)
            yield Chunk([first], self._finish_after_first(job.params, first))
            return
        first, stream = await self._place_and_prefill(job, route, placement, pred)
        try:
            first_finish = self._finish_after_first(job.params, first)
            yield Chunk([first], first_finish)
            if first_finish:  # nothing left to decode: free the reserved blocks now
                stream.cancel()
                await placement.leave_now(placement.decode)
                return
            async for chunk in self._decode(job, placement, stream):
                yield chunk
        finally:
            stream.cancel()  # (no-op once it finished)

    async def _place_and_prefill(
        self, job: Job, route: RouteRequest, placement: RequestPlacement, pred: Prediction
    ) -> tuple[int, StreamHandle]:
        """Reserve on a decode (its Decode stream), prefill `prompt` on a prefill that pushes
        the KV to it, return the first token and the stream. On return
        `placement.decode`/`.ticket` hold the decode that will continue the request. A
        prefill failure releases the decode (it may be picked again) and retries on another
        prefill, up to max_prefill_attempts."""
        prefills = Tries(self.registry, ROLE_PREFILL, self.max_prefill_attempts)
        prompt = job.token_ids
        while True:
            started = time.perf_counter()
            decode, stream = await self._reserve(job, route, placement, pred)
            job.stages.reserve_ms += (time.perf_counter() - started) * 1e3
            try:
                prefill = self._pick(prefills, route, decode=decode)
                resp = await self._prefill(job, placement, prefill, prompt)
            except _DecodeLost:  # the prefill is fine: retry it with another decode
                stream.cancel()
                log.warning("decode lost during prefill", instance=decode.instance_id)
                prefills.forget(prefill)
                placement.leave(prefill)
                placement.leave(decode)  # it is gone: do not wait for its Abort
                lost = UnavailableError(f"decode instance {decode.instance_id} was lost")
                prefills.failed(lost, job.prefill_attempts)
                continue
            except grpc.RpcError as err:
                stream.cancel()
                failure = self._failure(err, prefill, "prefill")
                log.warning(
                    "prefill failed",
                    instance=prefill.instance_id,
                    code=str(failure.code),
                    attempt=job.prefill_attempts,
                )
                placement.leave(prefill)
                await placement.leave_now(decode)  # free the ticket before re-reserving
                prefills.failed(failure, job.prefill_attempts)
                continue
            except BaseException:
                stream.cancel()  # the decode releases the reservation (so does the Abort)
                raise
            job.stages.add(stages_from_proto(resp.stages))
            return resp.first_token_id, stream

    async def _prefill_only(
        self, job: Job, route: RouteRequest, placement: RequestPlacement
    ) -> int:
        """Token 0 of a request that needs no other: Prefill without a ticket, retried on
        another prefill when one fails (up to max_prefill_attempts)."""
        prefills = Tries(self.registry, ROLE_PREFILL, self.max_prefill_attempts)
        while True:
            prefill = self._pick(prefills, route)
            try:
                resp = await self._prefill(job, placement, prefill, job.token_ids)
            except grpc.RpcError as err:
                failure = self._failure(err, prefill, "prefill")
                placement.leave(prefill)
                prefills.failed(failure, job.prefill_attempts)
                continue
            job.stages.add(stages_from_proto(resp.stages))
            return resp.first_token_id

    async def _prefill(
        self, job: Job, placement: RequestPlacement, prefill: Instance, prompt: list[int]
    ) -> worker_pb2.PrefillResponse:
        """Prefill on `prefill`, pushing the KV to the placement's decode (if it holds a
        ticket; without one, prefill only)."""
        job.prefill_attempts += 1
        job.prefill_instance = prefill.instance_id
        placement.charge(prefill, requests=1, tokens=len(prompt))
        call = self.workers.stub(prefill.address).Prefill(
            worker_pb2.PrefillRequest(
                request_id=job.request_id,
                token_ids=prompt,
                sampling=sampling_to_proto(job.params),
                ticket=ticket_to_proto(placement.ticket),
                use_kvstore=self.use_kvstore,
            ),
            timeout=self.deadlines.prefill_s,
            metadata=metadata_with_request_id(job.request_id),
        )
        if placement.decode is None:
            resp = await settle(call, "Prefill")
        else:
            resp = await self._prefill_while_decode_lives(call, placement.decode)
        self.registry.seen(prefill.instance_id)
        placement.leave(prefill, abort=False)  # done: its KV is on the decode (or nowhere)
        return resp

    async def _prefill_while_decode_lives(self, call, decode: Instance):
        """Await a Prefill call; cancel it when its decode instance turns suspect or stops
        heartbeating: a KV push to a dead decode would otherwise hang until the prefill's
        transfer timeout. A draining decode still counts as alive (it finishes its work)."""
        task = asyncio.ensure_future(settle(call, "Prefill"))
        # Retrieve its outcome even when we are cancelled as it fails (no "Task exception
        # was never retrieved" log).
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DECODE_WATCH_S)
                if done:
                    return task.result()
                inst = self.registry.get(decode.instance_id)
                if (
                    inst is None
                    or inst.suspect_since is not None
                    or self.registry.heartbeat_age(inst) > self.registry.heartbeat_timeout_s
                ):
                    self.registry.mark_suspect(decode.instance_id)
                    raise _DecodeLost
        finally:
            if not task.done():
                call.cancel()
                task.cancel()

    async def _decode(
        self, job: Job, placement: RequestPlacement, stream: StreamHandle
    ) -> AsyncIterator[Chunk]:
        """Relay the tokens after token 0 from the Decode stream whose ticket the prefill
        used. A failure ends this attempt; `Migrator` continues the request elsewhere."""
        decode = placement.decode
        try:
            async for chunk in self._relay(stream, decode, job, placement, "decode"):
                yield chunk
        except grpc.RpcError as err:  # failed before its first chunk: the Migrator's turn
            raise self._failure(err, decode, "decode") from None

    async def _reserve(
        self, job: Job, route: RouteRequest, placement: RequestPlacement, pred: Prediction
    ) -> tuple[Instance, StreamHandle]:
        """Open the Decode stream on a decode instance (its first message is the ticket);
        another one when it is dead or full; wait for
        capacity (the admission stage's `Capacity`: woken when the cluster changes) while
        every decode instance is full, up to `kv_queue_s`. Returns the decode, whose
        ticket is then `placement.ticket`, and its open Decode stream (ticket read)."""
        prompt = job.token_ids
        decodes = Tries(self.registry, ROLE_DECODE)  # every live decode, then wait
        overloaded: OverloadedError | None = None
        deadline = time.monotonic() + self.deadlines.kv_queue_s
        while True:
            try:
                decode = self._pick(decodes, route)
            except UnavailableError:
                if overloaded is None:
                    raise
                if not await self.capacity.wait(deadline):
                    raise overloaded from None
                decodes.reset()
                overloaded = None
                continue
            # Charged now, not when the ticket comes: concurrent picks see it at once. (It
            # may hold a reservation before we see the ticket: close() aborts it.)
            placement.charge(decode, requests=1)
            stream = self.workers.open_decode(
                decode.address, self._decode_request(job, route, prompt)
            )
            try:
                ticket = await self._read_ticket(stream, decode)
            except BaseException as err:
                stream.cancel()
                if not isinstance(err, grpc.RpcError):
                    raise
                failure = self._failure(err, decode, "decode")
                full = failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                # a refused Reserve holds nothing: waking every other waiter on its release
                # made them all retry at once, each refusal waking them again (a retry storm)
                placement.leave(decode, refused=full)
                if full:
                    overloaded = OverloadedError(str(failure))
                if overloaded is None:
                    decodes.failed(failure)  # (a full decode waits for capacity instead)
                elif failure.code not in RETRYABLE:
                    raise failure from None
                continue
            job.decode_instance = decode.instance_id
            placement.reserved(decode, ticket)
            self.length.placed(pred, decode.instance_id, len(prompt), route)
            return decode, stream

    async def _read_ticket(self, stream: StreamHandle, decode: Instance) -> DecodeTicket:
        """The Decode stream's first message (its ticket). A decode that is alive but busy
        is waited for, up to `reserve_s`; one that stops heartbeating is given up at once
        (the streams' watchdog cuts the read, as the relay's)."""
        watch = self.streams.watch(stream, decode.instance_id, self.deadlines.reserve_s)
        try:
            msg = await stream.read()
        except asyncio.CancelledError:
            if not cancelled_under_us():
                raise
            if watch.expired:
                raise CallTimedOut("Decode", "sent no ticket", self.deadlines.reserve_s) from None
            why = "the instance stopped heartbeating" if watch.lost else "the instance left"
            raise CallLost("Decode", why) from None
        finally:
            self.streams.unwatch(watch)
        if msg is grpc.aio.EOF:
            raise CallLost("Decode", "the stream ended before its ticket")
        if msg.ticket is None:
            raise CallLost("Decode", "its first message carried no ticket")
        self.registry.seen(decode.instance_id)
        return msg.ticket

    def _decode_request(
        self, job: Job, route: RouteRequest, prompt: list[int]
    ) -> worker_pb2.DecodeRequest:
        """How much KV to ask for: the prompt plus bounded headroom for the predicted
        output (`route.reserve_tokens`; the worker holds it when free, best effort)."""
        return worker_pb2.DecodeRequest(
            request_id=job.request_id,
            prompt_token_ids=prompt,
            sampling=sampling_to_proto(job.params),
            write_back=self.write_back,
            num_predicted_tokens=route.reserve_tokens,
            lease_s=self.lease_s,
        )

    # ------------------------------------------------------------ colocated
    async def _colocated(
        self, job: Job, route: RouteRequest, placement: RequestPlacement, pred: Prediction
    ) -> AsyncIterator[Chunk]:
        tries = Tries(self.registry, ROLE_COLOCATED, self.max_prefill_attempts)
        while True:
            inst = self._pick(tries, route)
            job.prefill_attempts += 1
            job.prefill_instance = job.decode_instance = inst.instance_id
            placement.charge(inst, requests=1, tokens=len(job.token_ids))
            call = self.workers.open_generate(
                inst.address,
                worker_pb2.WorkerGenerateRequest(
                    request_id=job.request_id,
                    token_ids=job.token_ids,
                    sampling=sampling_to_proto(job.params),
                    use_kvstore=self.use_kvstore,
                    write_back=self.write_back,
                ),
            )
            try:
                async for chunk in self._relay(call, inst, job, placement, "colocated"):
                    yield chunk
                return
            except grpc.RpcError as err:  # only raised before the first chunk (see _relay)
                failure = self._failure(err, inst, "colocated")
                placement.leave(inst)
                tries.failed(failure, job.prefill_attempts)

    # -------------------------------------------------------------- helpers
    def _predictor_block_size(self) -> int:
        """Block size for the predictor's prefix memory: the cluster's (any instance)."""
        for inst in self.registry.instances():
            if inst.block_size > 0:
                return inst.block_size
        return 0

    async def _relay(
        self, call, inst: Instance, job: Job, placement: RequestPlacement, what: str
    ) -> AsyncIterator[Chunk]:
        """Relay a TokenChunk stream with a deadline on every message. A failure before
        the first message is re-raised as grpc.RpcError (retryable by the caller);
        later failures become domain errors. Cancels the call when left early; the
        instance leaves the placement (without Abort) when it sends the finish.

        The orchestrator's `StreamWatch` (one task for every stream, not one per message or
        per stream) cancels the call when the instance is lost (expired, or silent for the
        heartbeat timeout: a hung or partitioned worker keeps its stream open and silent), so
        the read turns that into `StreamLost` at once instead of waiting for `decode_idle_s`
        (before the first message: a retryable `CallLost`, like any failure there), and when
        the stream stays silent past its read deadline (`DeadlineError`). The router's sweep
        may expire the instance and close its channel first: a call cut so is `StreamLost`
        too, by the registry's word (`lost()`)."""
        first, finished = True, False
        # the watchdog flags `watch.lost` / `watch.expired` before it cancels the call
        limit_s = self.deadlines.first_token_s
        watch = self.streams.watch(call, inst.instance_id, limit_s)

        def lost() -> bool:  # (the sweep may cut the call before the watchdog's tick)
            return watch.lost or self.registry.lost(inst.instance_id)

        try:
            while True:
                wait = self.deadlines.first_token_s if first else self.deadlines.decode_idle_s
                try:
                    msg = await call.read()
                    watch.seen(self.deadlines.decode_idle_s)
                    self.registry.seen(inst.instance_id)
                except asyncio.CancelledError:
                    # The call was cancelled, not this task: by the watchdog (`lost`, or
                    # silent past its deadline), or by the close of a dropped instance's
                    # channel.
                    if not cancelled_under_us():
                        raise
                    if watch.expired:
                        raise DeadlineError(
                            f"{what} instance {inst.instance_id} sent nothing for {wait:g} s"
                        ) from None
                    if first and lost():
                        raise CallLost(what, "the instance stopped heartbeating") from None
                    if lost():
                        raise self._stream_lost(inst, what) from None
                    if first:
                        raise CallLost(what) from None  # retryable, like an RpcError
                    raise self._failure(CallLost(what), inst, what) from None
                except grpc.RpcError as err:
                    if first:
                        raise
                    if lost():
                        raise self._stream_lost(inst, what) from None
                    raise self._failure(err, inst, what) from None
                if msg is grpc.aio.EOF:
                    if first:
                        raise CallLost(what, "the stream ended before its first message")
                    if lost():
                        raise self._stream_lost(inst, what)
                    raise UnavailableError(
                        f"{what} instance {inst.instance_id} ended the stream without finishing"
                    )
                first = False
                if msg.finish_reason:
                    job.stages.add(msg.stages)
                    finished = True
                    placement.leave(inst, abort=False)  # before yielding: we may be closed
                yield Chunk(msg.token_ids, msg.finish_reason)
                if finished:
                    return
        finally:
            self.streams.unwatch(watch)
            if not finished:
                call.cancel()

    @staticmethod
    def _stream_lost(inst: Instance, what: str) -> StreamLost:
        return StreamLost(f"{what} instance {inst.instance_id} stopped heartbeating mid-stream")

    def _failure(self, err: grpc.RpcError, inst: Instance, what: str) -> RemoteError:
        """The domain error for a worker's RPC failure; UNAVAILABLE makes it suspect."""
        failure = remote_error(err, f"{what} instance {inst.instance_id}")
        if failure.code == grpc.StatusCode.UNAVAILABLE:
            self.registry.mark_suspect(inst.instance_id)
        return failure

    def _pick(self, tries: Tries, route: RouteRequest, decode: Instance | None = None) -> Instance:
        """An untried instance of `tries`' role, chosen by the placement policy."""
        if tries.role == ROLE_DECODE:
            return tries.pick(lambda cands: self.policy.pick_decode(route, cands))
        inst = tries.pick(lambda cands: self.policy.pick_prefill(route, cands))
        self.policy.on_routed(route, inst, decode)
        return inst

    def _finish_after_first(self, params: SamplingParams, token: int) -> int:
        if not params.ignore_eos and token in self.eos_token_ids:
            return STOP
        if token in params.stop_token_ids:
            return STOP
        if params.max_tokens <= 1:
            return LENGTH
        return common_pb2.FINISH_REASON_UNSPECIFIED
