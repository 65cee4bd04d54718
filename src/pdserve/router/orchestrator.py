"""The request lifecycle across workers (DESIGN.md "Request lifecycle").

`Orchestrator.run(job)` is an async generator of `Chunk`s (token ids; the last
one carries the finish reason). Disaggregated: pick decode -> Reserve -> pick
prefill -> Prefill -> yield the first token at once -> Decode streams the rest.
Colocated: one Generate stream. Prefill failures before the first token are
retried elsewhere (the decode ticket is aborted and re-reserved). When the
consumer stops early (stop string, client cancel) the generator's `finally`
aborts the request on every instance still holding it; aborts are idempotent.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from pdserve.engine.params import SamplingParams
from pdserve.errors import DeadlineError, OverloadedError, UnavailableError
from pdserve.logging import get_logger
from pdserve.v1 import common_pb2, worker_pb2

from .policies import PlacementPolicy, RouteRequest
from .predictor import OutputLengthPredictor
from .registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, Instance, Registry
from .workers import RETRYABLE, WorkerClients, remote_error, request_metadata

log = get_logger("pdserve.router.orchestrator")
STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


DECODE_WATCH_S = 0.25  # how often a running Prefill checks that its decode still lives


class _DecodeLost(Exception):
    """The decode holding a request's ticket died while the prefill pushed its KV."""


@dataclass(frozen=True)
class Deadlines:
    reserve_s: float = 5.0
    kv_queue_s: float = 30.0  # wait this long for free decode KV blocks before giving up
    prefill_s: float = 120.0
    first_token_s: float = 120.0  # colocated Generate / Decode: wait for the first chunk
    decode_idle_s: float = 60.0  # longest gap between two chunks of a stream
    abort_s: float = 2.0


@dataclass
class Job:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sampling: common_pb2.SamplingParams  # forwarded to workers (max_tokens filled in)
    session_id: str = ""
    # Filled while it runs:
    stages: common_pb2.StageCosts = field(default_factory=common_pb2.StageCosts)
    prefill_instance: str = ""
    decode_instance: str = ""
    prefill_attempts: int = 0


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED


def add_stages(total: common_pb2.StageCosts, part: common_pb2.StageCosts) -> None:
    for f in common_pb2.StageCosts.DESCRIPTOR.fields:
        setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))


class Orchestrator:
    def __init__(
        self,
        registry: Registry,
        policy: PlacementPolicy,
        predictor: OutputLengthPredictor,
        workers: WorkerClients,
        deadlines: Deadlines,
        eos_token_ids: Sequence[int] = (),
        max_prefill_attempts: int = 3,
        lease_s: float = 0.0,
        use_kvstore: bool = False,
        write_back: bool = False,
        hasher=None,
    ) -> None:
        self.registry, self.policy, self.predictor = registry, policy, predictor
        self.workers, self.deadlines = workers, deadlines
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_prefill_attempts = max(1, max_prefill_attempts)
        self.lease_s, self.use_kvstore, self.write_back = lease_s, use_kvstore, write_back
        self.hasher = hasher
        self._background: set[asyncio.Task] = set()

    # -------------------------------------------------------------- public
    async def run(self, job: Job) -> AsyncIterator[Chunk]:
        prefills = self.registry.candidates(ROLE_PREFILL)
        decodes = self.registry.candidates(ROLE_DECODE)
        route = RouteRequest(
            job.request_id, job.token_ids, session_id=job.session_id, hasher=self.hasher
        )
        route.predicted_tokens = self.predictor.predict(len(job.token_ids), job.params.max_tokens)
        if prefills and decodes:
            gen = self._disagg(job, route)
        elif self.registry.candidates(ROLE_COLOCATED):
            gen = self._colocated(job, route)
        elif not decodes:
            raise UnavailableError("no decode (or colocated) instance is available")
        else:
            raise UnavailableError("no prefill instance is available")
        completion = 0
        try:
            async for chunk in gen:
                completion += len(chunk.token_ids)
                yield chunk
        finally:
            await gen.aclose()
            self.predictor.observe(len(job.token_ids), completion)

    async def close(self) -> None:
        """Wait for pending background aborts."""
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    # -------------------------------------------------------- disaggregated
    async def _disagg(self, job: Job, route: RouteRequest) -> AsyncIterator[Chunk]:
        ticket, decode, first, tried = None, None, None, set()
        n = len(job.token_ids)
        try:
            while first is None:
                decode, ticket = await self._reserve(job, route)
                prefill = self._pick(ROLE_PREFILL, route, exclude=tried, decode=decode)
                tried.add(prefill.instance_id)
                job.prefill_attempts += 1
                job.prefill_instance = prefill.instance_id
                self.registry.charge(prefill.instance_id, requests=1, tokens=n)
                try:
                    call = self.workers.stub(prefill.address).Prefill(
                        worker_pb2.PrefillRequest(
                            request_id=job.request_id,
                            token_ids=job.token_ids,
                            sampling=job.sampling,
                            ticket=ticket,
                            use_kvstore=self.use_kvstore,
                        ),
                        timeout=self.deadlines.prefill_s,
                        metadata=request_metadata(job.request_id),
                    )
                    resp = await self._prefill_while_decode_lives(call, decode)
                except _DecodeLost:  # the prefill is fine: retry it with another decode
                    log.warning("decode lost during prefill", instance=decode.instance_id)
                    self._abort_later(prefill, job.request_id)
                    self.registry.charge(decode.instance_id, requests=-1)
                    ticket, decode = None, None
                    tried.discard(prefill.instance_id)
                    if job.prefill_attempts >= self.max_prefill_attempts:
                        raise UnavailableError(
                            "the decode instance was lost during prefill "
                            f"({job.prefill_attempts} attempt(s))"
                        ) from None
                    continue
                except grpc.RpcError as err:
                    failure = remote_error(err, f"prefill instance {prefill.instance_id}")
                    log.warning(
                        "prefill failed",
                        instance=prefill.instance_id,
                        code=str(failure.code),
                        attempt=job.prefill_attempts,
                    )
                    if failure.code == grpc.StatusCode.UNAVAILABLE:
                        self.registry.mark_suspect(prefill.instance_id)
                    self._abort_later(prefill, job.request_id)
                    await self._abort(decode, job.request_id)  # free the ticket before re-reserving
                    self.registry.charge(decode.instance_id, requests=-1)
                    ticket, decode = None, None
                    self._give_up_or_retry(failure, job, ROLE_PREFILL, tried)
                    continue
                finally:
                    self.registry.charge(prefill.instance_id, requests=-1, tokens=-n)
                first = resp.first_token_id
                add_stages(job.stages, resp.stages)
            first_finish = self._finish_after_first(job.params, first)
            yield Chunk([first], first_finish)
            if first_finish:
                await self._abort(decode, job.request_id)  # nothing left to decode: free the blocks
                ticket = None
                return
            call = self.workers.stub(decode.address).Decode(
                worker_pb2.DecodeRequest(
                    request_id=job.request_id,
                    ticket_id=ticket.ticket_id,
                    prompt_token_ids=job.token_ids,
                    first_token_id=first,
                    sampling=job.sampling,
                    write_back=self.write_back,
                ),
                metadata=request_metadata(job.request_id),
            )
            try:
                async for chunk in self._relay(call, decode, job, "decode"):
                    if chunk.finish_reason:
                        ticket = None  # before yielding: the consumer may close us there
                    yield chunk
            except grpc.RpcError as err:  # failed before its first chunk: too late to retry
                failure = remote_error(err, f"decode instance {decode.instance_id}")
                if failure.code == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_suspect(decode.instance_id)
                raise failure from None
        finally:
            if ticket is not None and decode is not None:  # stopped early or failed
                self._abort_later(decode, job.request_id)
                if first is None and job.prefill_instance:
                    inst = self.registry.get(job.prefill_instance)
                    if inst is not None:
                        self._abort_later(inst, job.request_id)
            if decode is not None:
                self.registry.charge(decode.instance_id, requests=-1)

    async def _prefill_while_decode_lives(self, call, decode: Instance):
        """Await a Prefill call; cancel it when its decode instance turns suspect or stops
        heartbeating: a KV push to a dead decode would otherwise hang until the prefill's
        transfer timeout. A draining decode still counts as alive (it finishes its work)."""
        task = asyncio.ensure_future(call)
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

    async def _reserve(self, job: Job, route: RouteRequest) -> tuple[Instance, worker_pb2.Ticket]:
        """Reserve on a decode instance; another one when it is dead or full. When every
        decode instance is full, the request queues (backing off) for up to `kv_queue_s`:
        overload becomes waiting, as in a single engine, not an error."""
        tried: set[str] = set()
        last: Exception | None = None
        queue_deadline = time.monotonic() + self.deadlines.kv_queue_s
        backoff = 0.01
        while True:
            try:
                decode = self._pick(ROLE_DECODE, route, exclude=tried)
            except UnavailableError:
                if not isinstance(last, OverloadedError):
                    raise
                if time.monotonic() + backoff > queue_deadline:
                    raise last from None
                await asyncio.sleep(backoff)  # blocks free as running requests finish
                backoff = min(backoff * 2, 0.2)
                tried, last = set(), None
                continue
            tried.add(decode.instance_id)
            try:
                resp = await self.workers.stub(decode.address).Reserve(
                    worker_pb2.ReserveRequest(
                        request_id=job.request_id,
                        num_prompt_tokens=len(job.token_ids),
                        num_predicted_tokens=route.predicted_tokens,
                        lease_s=self.lease_s,
                        # early admission: decoding starts the moment the KV lands
                        prompt_token_ids=job.token_ids,
                        sampling=job.sampling,
                    ),
                    timeout=self.deadlines.reserve_s,
                    metadata=request_metadata(job.request_id),
                )
            except grpc.RpcError as err:
                failure = remote_error(err, f"decode instance {decode.instance_id}")
                if failure.code == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_suspect(decode.instance_id)
                if failure.code not in RETRYABLE:
                    raise failure from None
                self._abort_later(decode, job.request_id)
                last = (
                    OverloadedError(str(failure))
                    if failure.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                    else failure
                )
                continue
            job.decode_instance = decode.instance_id
            self.registry.charge(decode.instance_id, requests=1)
            return decode, resp.ticket

    # ------------------------------------------------------------ colocated
    async def _colocated(self, job: Job, route: RouteRequest) -> AsyncIterator[Chunk]:
        tried: set[str] = set()
        while True:
            inst = self._pick(ROLE_COLOCATED, route, exclude=tried)
            tried.add(inst.instance_id)
            job.prefill_attempts += 1
            job.prefill_instance = job.decode_instance = inst.instance_id
            self.registry.charge(inst.instance_id, requests=1, tokens=len(job.token_ids))
            call = self.workers.stub(inst.address).Generate(
                worker_pb2.WorkerGenerateRequest(
                    request_id=job.request_id,
                    token_ids=job.token_ids,
                    sampling=job.sampling,
                    use_kvstore=self.use_kvstore,
                    write_back=self.write_back,
                ),
                metadata=request_metadata(job.request_id),
            )
            started = False
            try:
                async for chunk in self._relay(call, inst, job, "colocated"):
                    started = True
                    yield chunk
                return
            except grpc.RpcError as err:  # only raised before the first chunk (see _relay)
                failure = remote_error(err, f"colocated instance {inst.instance_id}")
                if failure.code == grpc.StatusCode.UNAVAILABLE:
                    self.registry.mark_suspect(inst.instance_id)
                if started:
                    raise failure from None
                self._give_up_or_retry(failure, job, ROLE_COLOCATED, tried)
            finally:
                self.registry.charge(inst.instance_id, requests=-1, tokens=-len(job.token_ids))

    # -------------------------------------------------------------- helpers
    async def _relay(self, call, inst: Instance, job: Job, what: str) -> AsyncIterator[Chunk]:
        """Relay a TokenChunk stream with a deadline on every message. A failure before
        the first message is re-raised as grpc.RpcError (retryable by the caller);
        later failures become domain errors. Cancels the call when left early."""
        first, finished = True, False
        try:
            while True:
                wait = self.deadlines.first_token_s if first else self.deadlines.decode_idle_s
                try:
                    msg = await asyncio.wait_for(call.read(), wait)
                except asyncio.TimeoutError:
                    raise DeadlineError(
                        f"{what} instance {inst.instance_id} sent nothing for {wait:g} s"
                    ) from None
                except grpc.RpcError as err:
                    if first:
                        raise
                    failure = remote_error(err, f"{what} instance {inst.instance_id}")
                    if failure.code == grpc.StatusCode.UNAVAILABLE:
                        self.registry.mark_suspect(inst.instance_id)
                    raise failure from None
                if msg is grpc.aio.EOF:
                    raise UnavailableError(
                        f"{what} instance {inst.instance_id} ended the stream without finishing"
                    )
                first = False
                if msg.finish_reason:
                    add_stages(job.stages, msg.stages)
                    finished = True
                yield Chunk(list(msg.token_ids), msg.finish_reason)
                if finished:
                    return
        finally:
            if not finished:
                call.cancel()
                self._abort_later(inst, job.request_id)

    def _pick(
        self, role: int, route: RouteRequest, exclude: set[str], decode: Instance | None = None
    ) -> Instance:
        cands = [c for c in self.registry.candidates(role) if c.instance_id not in exclude]
        if not cands:
            kind = {ROLE_PREFILL: "prefill", ROLE_DECODE: "decode"}.get(role, "colocated")
            more = f" (tried {len(exclude)})" if exclude else ""
            raise UnavailableError(f"no {kind} instance is available{more}")
        if role == ROLE_DECODE:
            return self.policy.pick_decode(route, cands)
        inst = self.policy.pick_prefill(route, cands)
        self.policy.on_routed(route, inst, decode)
        return inst

    def _give_up_or_retry(self, failure: Exception, job: Job, role: int, tried: set[str]) -> None:
        """Raise unless another attempt is allowed and an untried instance exists."""
        if getattr(failure, "code", None) not in RETRYABLE:
            raise failure
        left = [c for c in self.registry.candidates(role) if c.instance_id not in tried]
        if not left or job.prefill_attempts >= self.max_prefill_attempts:
            raise UnavailableError(
                f"prefill failed on {job.prefill_attempts} instance(s); last: {failure}"
            ) from None

    def _finish_after_first(self, params: SamplingParams, token: int) -> int:
        if not params.ignore_eos and token in self.eos_token_ids:
            return STOP
        if token in params.stop_token_ids:
            return STOP
        if params.max_tokens <= 1:
            return LENGTH
        return common_pb2.FINISH_REASON_UNSPECIFIED

    async def _abort(self, inst: Instance, request_id: str) -> None:
        try:
            await self.workers.stub(inst.address).Abort(
                worker_pb2.AbortRequest(request_id=request_id),
                timeout=self.deadlines.abort_s,
                metadata=request_metadata(request_id),
            )
        except grpc.RpcError as err:
            log.info("abort failed", instance=inst.instance_id, code=str(err.code()))

    def _abort_later(self, inst: Instance, request_id: str) -> None:
        """Abort without waiting (safe to call while being cancelled)."""
        task = asyncio.get_running_loop().create_task(self._abort(inst, request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
