"""The one domain path behind every public front door (gRPC Router service and the OpenAI
HTTP API): authenticate -> admission per key -> tokenize and validate -> predict the
output length -> the admission queue's turn (bounded, FCFS or SJF by the prediction) ->
Orchestrator.run -> detokenize and stop strings -> usage, metrics, log line. The request
passes admission once (scheduling/admission.py); a migrated stream keeps its turn.

Both front doors build a `router_pb2.GenerateRequest` (the HTTP API in http/openai.py)
and consume `router_pb2.GenerateResponse` messages, so a request means the
same thing, is checked by the same code and fails with the same errors on either door.
Errors are domain errors (pdserve.errors); each door maps them (gRPC: the ErrorInterceptor;
HTTP: pdserve.router.frontdoor.http.errors).
"""

from __future__ import annotations

import asyncio
import secrets
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pdserve.errors import (
    AlreadyExistsError,
    InvalidRequestError,
    PdserveError,
    UnavailableError,
)
from pdserve.logging import bind_request_id, debug_enabled, get_logger
from pdserve.rpc.ids import MAX_ID_CHARS, check_id
from pdserve.rpc.interceptor import status_for
from pdserve.v1 import common_pb2, router_pb2

from ..cluster.peers import PeerRouters
from ..cluster.registry import Registry
from ..cluster.workers import cancelled_under_us
from ..job import Job
from ..lifecycle.orchestrator import Orchestrator
from ..metrics import RouterMetrics, Totals
from ..scheduling.admission import Admission
from .auth import ApiKey, ApiKeys
from .input_limits import FALLBACK_MAX_PROMPT_CHARS, InputLimits, check_raw_request
from .model_info import ModelInfo
from .resume import ResumeTokens, accept_resume
from .text import TextStream
from .validation import check_messages, check_request, to_params

log = get_logger("pdserve.router")
_debug = debug_enabled("pdserve.router")  # "request finished" is at DEBUG


def _reason(finish: int) -> str:
    name = common_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
    _REASONS[finish] = name
    return name


_REASONS: dict[int, str] = {}  # FinishReason -> its metric label


def worker_request_id(rid: str) -> str:
    """The id the workers see: the client's id (truncated) + a random suffix. Workers key
    their state by request id and may still hold a finished request's blocks (write-back)
    when the client reuses its id; one client request never shares worker state with
    another, whatever ids clients choose."""
    return f"{rid[: MAX_ID_CHARS - 9]}.{secrets.token_hex(4)}"


class FrontDoor:
    def __init__(
        self,
        orchestrator: Orchestrator,
        registry: Registry,
        model: ModelInfo,
        metrics: RouterMetrics,
        totals: Totals,
        keys: ApiKeys,
        admission: Admission,
        kvstore_addr: str = "",
        limits: InputLimits | None = None,
        resume_tokens: ResumeTokens | None = None,
        peers: PeerRouters | None = None,
        shared_store: Any = None,  # replicas/store.SharedStore: its state in Status
    ) -> None:
        self.orch, self.registry, self.model = orchestrator, registry, model
        self.metrics, self.totals, self.kvstore_addr = metrics, totals, kvstore_addr
        self.keys, self.admission = keys, admission
        self.limits = limits or InputLimits(
            FALLBACK_MAX_PROMPT_CHARS, 256, model.max_model_len, model.max_model_len
        )
        self.resume_tokens = resume_tokens  # None: streams get no resume token
        self.peers, self.shared_store = peers, shared_store
        self.inflight: set[str] = set()  # request ids being served (a duplicate is refused)
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()

    async def drain(self) -> None:
        """Refuse new requests (both doors: UNAVAILABLE / 503); return once the running
        ones are done."""
        self.draining = True
        await self.idle.wait()

    def authenticate(self, authorization: str | None) -> ApiKey:
        return self.keys.authenticate(authorization)

    async def generate(
        self,
        request: router_pb2.GenerateRequest,
        key: ApiKey,
        oracle_tokens: int = 0,
        resume: router_pb2.ResumeRequest | None = None,
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """The response stream of one request; raises domain errors (before the first
        message or mid-stream). `oracle_tokens`: the true output length a benchmark request
        carries (used only when the router runs in oracle mode).

        Every request that got an id ends in exactly one way, counted and logged with its
        request_id: finished (`router_requests{finish_reason}`; "request finished" at
        DEBUG), failed at any stage (`router_request_errors{code}`; "request failed" at
        INFO, with the error and how far it got) or left by its client
        (`router_requests{finish_reason="abort"}`; "request cancelled by the client")."""
        t0 = time.perf_counter()
        rid = check_id("request_id", request.request_id or uuid.uuid4().hex)
        bind_request_id(rid)
        progress = {"prompt_tokens": 0, "completion_tokens": 0}
        ended = False  # counted and logged as finished (before its last response is sent)
        try:
            if self.draining:
                raise UnavailableError("router is draining")
            if rid in self.inflight:
                raise AlreadyExistsError(f"request_id {rid!r} is already in flight")
            self.inflight.add(rid)
            try:
                check_raw_request(request, self.limits)  # before any expensive work
                async with self.admission.admit(key) as admission:
                    job, stops = await self._prepare(request, rid)
                    job.oracle_tokens = oracle_tokens
                    progress["prompt_tokens"] = len(job.token_ids)
                    text = TextStream(self.model.detokenizer(), stops)
                    received, held = self._resumed(resume, key, rid, job, text)
                    admission.charge(len(job.token_ids))
                    pred = await self.orch.predict(job)
                    await admission.turn(pred.predicted_tokens)  # once: migrations keep it
                    totals = self.totals
                    totals.requests += 1
                    totals.running += 1
                    self.idle.clear()
                    n_out, t_first, finish = len(received), 0.0, 0
                    token = ""  # the resume token, sent with the first tokens
                    gen = self.orch.run(job, pred, received)
                    try:
                        # One chunk = every token relayed since the last one was sent: while
                        # a write to the client is in flight, tokens merge (a busy router
                        # sends fewer, larger messages).
                        async for chunk in gen:
                            step = text.push(chunk.token_ids)
                            n_out += len(step.token_ids)
                            progress["completion_tokens"] = n_out
                            admission.charge(len(step.token_ids))
                            if not t_first:
                                t_first = time.perf_counter()
                                if self.resume_tokens is not None:
                                    token = self.resume_tokens.issue(rid, key.name, job)
                            finish, delta = chunk.finish_reason, step.text
                            if held:
                                delta, held = held + delta, ""
                            if step.stopped:
                                finish = common_pb2.FINISH_REASON_STOP
                            elif finish:
                                delta += text.finish()  # held-back text (or a stop inside it)
                                if text.matcher.matched is not None:
                                    finish = common_pb2.FINISH_REASON_STOP
                            resp = router_pb2.GenerateResponse(
                                request_id=rid,
                                token_ids=step.token_ids,
                                text=delta,
                                server_ms=(time.perf_counter() - t0) * 1000.0,
                                finish_reason=finish,
                                resume_token=token,
                            )
                            token = ""
                            if finish:
                                resp.usage.CopyFrom(self._usage(job, n_out, t0, t_first))
                                # finished now: a door may close us at this last yield
                                # (HTTP stops reading at the finish), not a cancel
                                self._observe(job, key, finish, n_out, t0, t_first)
                                ended = True
                                yield resp
                                break
                            yield resp
                    finally:
                        await gen.aclose()  # stop string / cancel: the workers are aborted
                        totals.running -= 1
                        if not totals.running:
                            self.idle.set()
                    if not ended:  # (an orchestrator always ends with a finish or raises)
                        self._observe(job, key, finish, n_out, t0, t_first)
            finally:
                self.inflight.discard(rid)
        except asyncio.CancelledError:
            if cancelled_under_us():  # not the client: a cancel leaked from a call we made
                exc = UnavailableError("the request was cancelled inside the router")
                self._failed(exc, key, t0, progress, internal=True)
                raise exc from None
            if not ended:
                self._cancelled(key, t0, progress)
            raise
        except GeneratorExit:  # the client went away (at any stage), or the door is done
            if not ended:
                self._cancelled(key, t0, progress)
            raise
        except Exception as exc:
            self._failed(exc, key, t0, progress)
            raise

    async def resume(
        self, resume: router_pb2.ResumeRequest, key: ApiKey
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        """Continue a stream another router started (its router died): checked by
        `resume.py` (token, key, finished), then run as a migration from the received
        tokens. Its messages are Generate's."""
        if not resume.request.request_id:
            raise InvalidRequestError("request.request_id", "a resumed stream needs its request id")
        if not resume.received_token_ids:
            raise InvalidRequestError(
                "received_token_ids", "empty: nothing to resume (send the request with Generate)"
            )
        async for resp in self.generate(resume.request, key, 0, resume):
            yield resp

    def _cancelled(self, key: ApiKey, t0: float, progress: dict[str, int]) -> None:
        self.metrics.finished("abort").inc()
        log.info(
            "request cancelled by the client",
            key=key.name,
            e2e_s=round(time.perf_counter() - t0, 4),
            **progress,
        )

    def _failed(
        self,
        exc: Exception,
        key: ApiKey,
        t0: float,
        progress: dict[str, int],
        internal: bool = False,  # a bug: said at ERROR
    ) -> None:
        code, details = status_for(exc)
        self.metrics.errors.labels(code=code.name).inc()
        (log.error if internal else log.info)(
            "request failed",
            code=code.name,
            error=details,
            key=key.name,
            e2e_s=round(time.perf_counter() - t0, 4),
            **progress,
        )

    def status(self) -> router_pb2.StatusResponse:
        vocab, context = self.model.known_limits
        instances = self.registry.instances()
        resp = router_pb2.StatusResponse(
            requests_total=self.totals.requests,
            requests_running=self.totals.running,
            prompt_tokens_total=self.totals.prompt_tokens,
            cached_tokens_total=self.totals.cached_tokens,
            model=self.model.name,
            kvstore_address=self.kvstore_addr,
            vocab_size=vocab,
            context_length=context,
            block_size=instances[0].block_size if instances else 0,
            dtype=",".join(sorted({i.dtype for i in instances if i.dtype})),  # what is served
            checkpoint_dtype=self.model.dtype,
        )
        length = self.orch.length
        resp.predictor = length.predictor.name
        resp.predictor_kendall_tau = length.running_tau()
        resp.predictor_observed = length.learned
        resp.queue_waiting = self.admission.waiting
        if self.peers is not None:
            resp.router_id = self.peers.me.router_id
            for r in self.peers.known(i.instance_id for i in instances):
                resp.routers.append(
                    router_pb2.RouterStatus(
                        router_id=r.identity.router_id,
                        address=r.identity.address,
                        http_address=r.identity.http_address,
                        workers=r.workers,
                        is_self=r.is_self,
                    )
                )
        if self.shared_store is not None:
            resp.shared_store = self.shared_store.describe()
        for inst in instances:
            state = "suspect" if inst.suspect_since is not None else inst.state
            resp.instances.append(
                router_pb2.InstanceStatus(
                    instance_id=inst.instance_id,
                    address=inst.address,
                    role=inst.role,
                    state=state,
                    load=common_pb2.WorkerLoad(**inst.load.__dict__),
                    heartbeat_age_s=self.registry.heartbeat_age(inst),
                    model_fingerprint=inst.model_fingerprint,
                    dtype=inst.dtype,
                    kernels=inst.kernels,
                )
            )
        return resp

    # -------------------------------------------------------------- helpers
    def _resumed(
        self,
        resume: router_pb2.ResumeRequest | None,
        key: ApiKey,
        rid: str,
        job: Job,
        text: TextStream,
    ) -> tuple[list[int], str]:
        """For a resumed stream: (the tokens the client received, text it is still owed),
        after checking its token and that it has not finished; `text` replays the received
        tokens (a stop string may span the seam). A new stream: ([], "")."""
        if resume is None:
            return [], ""
        try:
            if self.resume_tokens is None:
                raise UnavailableError("this router does not resume streams (no resume secret)")
            out = accept_resume(
                resume, self.resume_tokens, key.name, self.keys.names(), rid, job, text, self.model
            )
        except PdserveError as exc:
            self.metrics.resumes.labels(exc.code.name.lower()).inc()
            log.info("resume refused", key=key.name, code=exc.code.name, error=str(exc))
            raise
        self.metrics.resumes.labels("resumed").inc()
        log.info("stream resumed", key=key.name, received_tokens=len(out[0]))
        return out

    async def _prepare(
        self, request: router_pb2.GenerateRequest, rid: str
    ) -> tuple[Job, list[str]]:
        kind = request.WhichOneof("prompt")
        prompt_text = None  # what the length predictor reads
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("prompt", "text must not be empty")
            token_ids = await asyncio.to_thread(self.model.encode, request.text)
            prompt_text = request.text
        elif kind == "chat":
            messages = [(m.role, m.content) for m in request.chat.messages]
            check_messages(messages)
            token_ids = await asyncio.to_thread(self.model.encode_chat, messages)
            prompt_text = "\n".join(content for _, content in messages)
        elif kind == "token_ids":
            token_ids = list(request.token_ids.ids)
        else:
            raise InvalidRequestError("prompt", "set one of text, chat or token_ids")
        if len(token_ids) > self.limits.max_prompt_tokens:
            raise InvalidRequestError("prompt", self.limits.too_many_tokens(len(token_ids)))
        stops = list(request.sampling.stop)
        params = to_params(request.sampling, len(token_ids), self.model.max_model_len)
        check_request(
            token_ids,
            params,
            stops,
            request.session_id,
            self.model.vocab_size,
            self.model.max_model_len,
            self.limits.max_stop_strings,
            self.limits.max_stop_chars,
        )
        self.totals.prompt_tokens += len(token_ids)
        self.metrics.prompt_tokens.inc(len(token_ids))
        return Job(
            request_id=worker_request_id(rid),
            token_ids=token_ids,
            params=params,
            session_id=request.session_id,
            prompt_text=prompt_text,
            model=self.model.name,
        ), stops

    def _usage(self, job: Job, n_out: int, t0: float, t_first: float) -> router_pb2.Usage:
        now = time.perf_counter()
        usage = router_pb2.Usage(
            prompt_tokens=len(job.token_ids),
            completion_tokens=n_out,
            cached_tokens=job.stages.cached_tokens,
            ttft_ms=(t_first - t0) * 1000.0 if t_first else 0.0,
            e2e_ms=(now - t0) * 1000.0,
            prefill_instance=job.prefill_instance,
            decode_instance=job.decode_instance,
        )
        s, out = job.stages, usage.stages
        out.queue_ms, out.prefill_ms, out.transfer_ms = s.queue_ms, s.prefill_ms, s.transfer_ms
        out.transfer_bytes, out.decode_ms, out.reserve_ms = (
            s.transfer_bytes, s.decode_ms, s.reserve_ms
        )  # fmt: skip
        out.cached_tokens, out.kvstore_tokens = s.cached_tokens, s.kvstore_tokens
        return usage

    def _observe(
        self, job: Job, key: ApiKey, finish: int, n_out: int, t0: float, t_first: float
    ) -> None:
        now = time.perf_counter()
        reason = _REASONS.get(finish) or _reason(finish)
        self.metrics.finished(reason).inc()
        self.metrics.completion_tokens.inc(n_out)
        if job.stages.cached_tokens:
            self.metrics.cached_tokens.inc(job.stages.cached_tokens)
        self.totals.cached_tokens += job.stages.cached_tokens
        if job.prefill_attempts > 1:
            self.metrics.prefill_retries.inc(job.prefill_attempts - 1)
        if t_first:
            self.metrics.ttft.observe(t_first - t0)
            if n_out > 1:
                self.metrics.tpot.observe((now - t_first) / (n_out - 1))
        self.metrics.e2e.observe(now - t0)
        if not _debug():
            return
        log.debug(
            "request finished",
            finish_reason=reason,
            key=key.name,
            prompt_tokens=len(job.token_ids),
            completion_tokens=n_out,
            cached_tokens=job.stages.cached_tokens,
            prefill=job.prefill_instance,
            decode=job.decode_instance,
        )
