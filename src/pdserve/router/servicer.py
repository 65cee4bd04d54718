"""gRPC servicers: proto <-> domain only. Router (Generate, Status) for clients,
Registry (Register, Heartbeat, Deregister) for workers. Domain errors raised
here are mapped to status codes by pdserve.rpc's ErrorInterceptor."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from pdserve.errors import InvalidRequestError, UnavailableError
from pdserve.logging import bind_request_id, get_logger
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from .metrics import RouterMetrics, Totals
from .model_info import ModelInfo
from .orchestrator import Job, Orchestrator
from .registry import LoadReport, Registry
from .text import TextStream
from .validation import check_messages, check_request, to_params

log = get_logger("pdserve.router")


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(
        self,
        orchestrator: Orchestrator,
        registry: Registry,
        model: ModelInfo,
        metrics: RouterMetrics,
        totals: Totals,
        kvstore_addr: str = "",
    ) -> None:
        self.orch, self.registry, self.model = orchestrator, registry, model
        self.metrics, self.totals, self.kvstore_addr = metrics, totals, kvstore_addr
        self._draining = False
        self._idle = asyncio.Event()  # set while no Generate is running
        self._idle.set()

    async def drain(self) -> None:
        """Refuse new requests; return once the running ones are done."""
        self._draining = True
        await self._idle.wait()

    async def Generate(
        self, request: router_pb2.GenerateRequest, context
    ) -> AsyncIterator[router_pb2.GenerateResponse]:
        t0 = time.perf_counter()
        rid = request.request_id or uuid.uuid4().hex
        bind_request_id(rid)
        if self._draining:
            raise UnavailableError("router is draining")
        job, stops = await self._prepare(request, rid)
        text = TextStream(self.model.detokenizer(), stops)
        self.totals.requests += 1
        self.totals.running += 1
        self._idle.clear()
        n_out, t_first, finish = 0, 0.0, 0
        gen = self.orch.run(job)
        try:
            async for chunk in gen:
                step = text.push(chunk.token_ids)
                n_out += len(step.token_ids)
                if not t_first:
                    t_first = time.perf_counter()
                finish, delta = chunk.finish_reason, step.text
                if step.stopped:
                    finish = common_pb2.FINISH_REASON_STOP
                elif finish:
                    delta += text.finish()  # release held-back text (or stop inside it)
                    if text.matcher.matched is not None:
                        finish = common_pb2.FINISH_REASON_STOP
                resp = router_pb2.GenerateResponse(
                    request_id=rid,
                    token_ids=step.token_ids,
                    text=delta,
                    server_ms=(time.perf_counter() - t0) * 1000.0,
                    finish_reason=finish,
                )
                if finish:
                    resp.usage.CopyFrom(self._usage(job, n_out, t0, t_first))
                    yield resp
                    break
                yield resp
        except asyncio.CancelledError:  # the client went away
            self.metrics.requests.labels(finish_reason="abort").inc()
            raise
        except Exception as exc:
            code = getattr(exc, "code", None)
            self.metrics.errors.labels(code=getattr(code, "name", type(exc).__name__)).inc()
            raise
        finally:
            await gen.aclose()  # stop string / cancel: the orchestrator aborts the workers
            self.totals.running -= 1
            if not self.totals.running:
                self._idle.set()
        self._observe(job, finish, n_out, t0, t_first)

    async def Status(self, request: router_pb2.StatusRequest, context) -> router_pb2.StatusResponse:
        resp = router_pb2.StatusResponse(
            requests_total=self.totals.requests,
            requests_running=self.totals.running,
            prompt_tokens_total=self.totals.prompt_tokens,
            cached_tokens_total=self.totals.cached_tokens,
            model=self.model.name,
            kvstore_address=self.kvstore_addr,
        )
        for inst in self.registry.instances():
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
                )
            )
        return resp

    # -------------------------------------------------------------- helpers
    async def _prepare(
        self, request: router_pb2.GenerateRequest, rid: str
    ) -> tuple[Job, list[str]]:
        kind = request.WhichOneof("prompt")
        if kind == "text":
            if not request.text:
                raise InvalidRequestError("prompt", "text must not be empty")
            token_ids = await asyncio.to_thread(self.model.encode, request.text)
        elif kind == "chat":
            messages = [(m.role, m.content) for m in request.chat.messages]
            check_messages(messages)
            token_ids = await asyncio.to_thread(self.model.encode_chat, messages)
        elif kind == "token_ids":
            token_ids = list(request.token_ids.ids)
        else:
            raise InvalidRequestError("prompt", "set one of text, chat or token_ids")
        stops = list(request.sampling.stop)
        params = to_params(request.sampling, len(token_ids), self.model.max_model_len)
        check_request(
            token_ids,
            params,
            stops,
            request.session_id,
            self.model.vocab_size,
            self.model.max_model_len,
        )
        sampling = common_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        sampling.max_tokens = params.max_tokens
        del sampling.stop[:]  # stop strings are the router's business
        self.totals.prompt_tokens += len(token_ids)
        self.metrics.prompt_tokens.inc(len(token_ids))
        return Job(
            request_id=rid,
            token_ids=token_ids,
            params=params,
            sampling=sampling,
            session_id=request.session_id,
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
        usage.stages.CopyFrom(job.stages)
        return usage

    def _observe(self, job: Job, finish: int, n_out: int, t0: float, t_first: float) -> None:
        now = time.perf_counter()
        reason = common_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower()
        self.metrics.requests.labels(finish_reason=reason).inc()
        self.metrics.completion_tokens.inc(n_out)
        self.metrics.cached_tokens.inc(job.stages.cached_tokens)
        self.totals.cached_tokens += job.stages.cached_tokens
        if job.prefill_attempts > 1:
            self.metrics.prefill_retries.inc(job.prefill_attempts - 1)
        if t_first:
            self.metrics.ttft.observe(t_first - t0)
            if n_out > 1:
                self.metrics.tpot.observe((now - t_first) / (n_out - 1))
        self.metrics.e2e.observe(now - t0)
        log.info(
            "request finished",
            finish_reason=reason,
            prompt_tokens=len(job.token_ids),
            completion_tokens=n_out,
            cached_tokens=job.stages.cached_tokens,
            prefill=job.prefill_instance,
            decode=job.decode_instance,
        )


class RegistryServicer(router_pb2_grpc.RegistryServicer):
    def __init__(
        self, registry: Registry, heartbeat_interval_s: float, kvstore_addr: str = ""
    ) -> None:
        self.registry = registry
        self.heartbeat_interval_s = heartbeat_interval_s
        self.kvstore_addr = kvstore_addr

    async def Register(
        self, request: router_pb2.RegisterRequest, context
    ) -> router_pb2.RegisterResponse:
        inst = self.registry.register(
            request.instance_id,
            request.address,
            request.role,
            request.model_fingerprint,
            request.block_size,
            LoadReport.from_proto(request.load),
        )
        log.info(
            "instance registered",
            instance=inst.instance_id,
            address=inst.address,
            role=inst.role_name,
        )
        return router_pb2.RegisterResponse(
            heartbeat_interval_s=self.heartbeat_interval_s, kvstore_address=self.kvstore_addr
        )

    async def Heartbeat(
        self, request: router_pb2.HeartbeatRequest, context
    ) -> router_pb2.HeartbeatResponse:
        known = self.registry.heartbeat(
            request.instance_id, request.role, request.state, LoadReport.from_proto(request.load)
        )
        return router_pb2.HeartbeatResponse(known=known)

    async def Deregister(
        self, request: router_pb2.DeregisterRequest, context
    ) -> router_pb2.DeregisterResponse:
        if self.registry.deregister(request.instance_id):
            log.info("instance deregistered", instance=request.instance_id)
        return router_pb2.DeregisterResponse()
