"""AsyncClient: the asyncio SDK for the router's public API."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

from .errors import PdserveClientError, Unavailable, from_rpc_error
from .results import (
    FINISH_REASONS,
    ROLES,
    ClusterStatus,
    GenerationEvent,
    GenerationResult,
    InstanceInfo,
    RouterInfo,
    Usage,
    collect,
)
from .routers import Routers

DEFAULT_ADDR = "127.0.0.1:50051"
API_KEY_ENV = "PDSERVE_CLIENT_API_KEY"  # not PDSERVE_API_KEY: that is the router's key list
_CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.keepalive_time_ms", 30_000),
    # a router restarting (or a replica coming back) is found within a second, not after
    # grpc's default reconnect back-off (up to 120 s)
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def build_request(
    *,
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int = 0,
    seed: int | None = None,
    ignore_eos: bool = False,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    session_id: str | None = None,
    request_id: str | None = None,
) -> router_pb2.GenerateRequest:
    given = [x is not None for x in (prompt, token_ids, messages)]
    if sum(given) != 1:
        raise ValueError("pass exactly one of prompt, token_ids or messages")
    sampling = common_pb2.SamplingParams(
        top_k=top_k, ignore_eos=ignore_eos, stop=list(stop), stop_token_ids=list(stop_token_ids)
    )
    if max_tokens is not None:
        sampling.max_tokens = max_tokens
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    req = router_pb2.GenerateRequest(
        request_id=request_id or "", sampling=sampling, session_id=session_id or ""
    )
    if prompt is not None:
        req.text = prompt
    elif token_ids is not None:
        req.token_ids.ids.extend(token_ids)
    else:
        req.chat.messages.extend(
            router_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages or ()
        )
    return req


def _usage(u: router_pb2.Usage) -> Usage:
    stages = {f.name: getattr(u.stages, f.name) for f in common_pb2.StageCosts.DESCRIPTOR.fields}
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        cached_tokens=u.cached_tokens,
        ttft_ms=u.ttft_ms,
        e2e_ms=u.e2e_ms,
        stages=stages,
        prefill_instance=u.prefill_instance,
        decode_instance=u.decode_instance,
    )


def _status(resp: router_pb2.StatusResponse) -> ClusterStatus:
    load_fields = [f.name for f in common_pb2.WorkerLoad.DESCRIPTOR.fields]
    return ClusterStatus(
        instances=[
            InstanceInfo(
                instance_id=i.instance_id,
                address=i.address,
                role=ROLES.get(i.role, str(i.role)),
                state=i.state,
                heartbeat_age_s=i.heartbeat_age_s,
                load={f: getattr(i.load, f) for f in load_fields},
                model_fingerprint=i.model_fingerprint,
                dtype=i.dtype,
                kernels=i.kernels,
            )
            for i in resp.instances
        ],
        requests_total=resp.requests_total,
        requests_running=resp.requests_running,
        prompt_tokens_total=resp.prompt_tokens_total,
        cached_tokens_total=resp.cached_tokens_total,
        model=resp.model,
        kvstore_address=resp.kvstore_address,
        vocab_size=resp.vocab_size,
        context_length=resp.context_length,
        block_size=resp.block_size,
        dtype=resp.dtype,
        predictor=resp.predictor,
        predictor_kendall_tau=resp.predictor_kendall_tau,
        predictor_observed=resp.predictor_observed,
        queue_waiting=resp.queue_waiting,
        checkpoint_dtype=resp.checkpoint_dtype,
        routers=[
            RouterInfo(r.router_id, r.address, r.http_address, r.workers, r.is_self)
            for r in resp.routers
        ],
        router_id=resp.router_id,
        shared_store=resp.shared_store,
    )


class AsyncClient:
    """`addr`: one router, or several replicas ("a:1,b:2" or ["a:1", "b:2"]): each call
    picks the next live one (round robin) and moves on when one fails.

    `timeout`: default per-call deadline in seconds (None = none). A call that fails with
    UNAVAILABLE before its first token is retried `max_retries` times, on the next router,
    with exponential backoff from `retry_backoff_s`. A stream whose router dies after
    tokens arrived is resumed on another replica (or on the same address once it is back)
    for up to `resume_timeout_s`: the router continues it from the tokens received, so the
    caller sees every token once, in order (docs/FAULTS.md, "Router replicas").
    `api_key` (default: $PDSERVE_CLIENT_API_KEY) is sent as `authorization: Bearer KEY`."""

    def __init__(
        self,
        addr: str | Sequence[str] = DEFAULT_ADDR,
        *,
        timeout: float | None = None,
        max_retries: int = 3,
        retry_backoff_s: float = 0.1,
        api_key: str | None = None,
        resume_timeout_s: float = 30.0,
    ) -> None:
        self.routers = Routers(addr)
        self.addr = ",".join(self.routers.addrs)
        key = api_key if api_key is not None else os.environ.get(API_KEY_ENV, "")
        self._auth: tuple[tuple[str, str], ...] = (
            (("authorization", f"Bearer {key}"),) if key else ()
        )
        self.timeout = timeout
        self.max_retries = max_retries
        self.retry_backoff_s = retry_backoff_s
        self.resume_timeout_s = resume_timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, router_pb2_grpc.RouterStub] = {}

    def _stub(self, addr: str) -> router_pb2_grpc.RouterStub:
        stub = self._stubs.get(addr)
        if stub is None:  # created on first use, on the loop that uses it
            channel = grpc.aio.insecure_channel(addr, options=_CHANNEL_OPTIONS)
            self._channels[addr] = channel
            stub = self._stubs[addr] = router_pb2_grpc.RouterStub(channel)
        return stub

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for channel in channels:
            await channel.close()

    async def generate_stream(
        self, *, timeout: float | None = None, **kwargs: Any
    ) -> AsyncIterator[GenerationEvent]:
        """Yields one GenerationEvent per router message; the last one has
        finish_reason and usage. Keyword arguments: see `build_request`, plus
        `oracle_tokens` (benchmarks only: the true output length, sent as metadata and
        honored only by a router started with --predictor-oracle)."""
        kwargs.setdefault("request_id", uuid.uuid4().hex)
        oracle = int(kwargs.pop("oracle_tokens", 0) or 0)
        req = build_request(**kwargs)
        metadata: tuple[tuple[str, str], ...] = (("x-request-id", req.request_id),)
        if oracle > 0:
            metadata += (("pdserve-oracle-tokens", str(oracle)),)
        timeout = self.timeout if timeout is None else timeout
        deadline = None if timeout is None else time.monotonic() + timeout
        stream = _StreamState()
        attempt = 0  # failed tries before the first token
        failures: dict[str, str] = {}  # router -> its last failure (the final error names them)
        while True:
            addr = self.routers.pick()
            left = None if deadline is None else max(0.001, deadline - time.monotonic())
            call = self._open(addr, req, stream, left, metadata)
            try:
                while True:  # to the end of the call: the router finishes its bookkeeping
                    msg = await call.read()
                    if msg is grpc.aio.EOF:
                        return
                    event = stream.take(msg)
                    yield event
            except grpc.RpcError as err:
                if stream.finished:  # the last message arrived; the router died after it
                    return
                error = from_rpc_error(err)
                if not isinstance(error, Unavailable):
                    raise error from None
                self.routers.failed(addr)
                failures[addr] = error.message
                now = time.monotonic()
                if stream.received:  # mid-stream: resume elsewhere, if the router died
                    if error.elsewhere:  # no instance there: try the routers that have not said so
                        stream.no_instance_at.add(addr)
                    exhausted = stream.no_instance_at.issuperset(self.routers.addrs)
                    verdict = error.answered and not (error.elsewhere and not exhausted)
                    if not stream.resume_token or verdict:  # (it answered: its verdict)
                        raise error from None
                    stream.resume_deadline = stream.resume_deadline or now + self.resume_timeout_s
                    backoff = self.routers.backoff(stream.resumes, self.retry_backoff_s)
                    stream.resumes += 1
                    give_up = now + backoff > stream.resume_deadline
                else:
                    backoff = self.routers.backoff(attempt, self.retry_backoff_s)
                    attempt += 1
                    give_up = attempt > self.max_retries
                if give_up or (deadline is not None and now + backoff >= deadline):
                    raise self.routers.unavailable(error, failures) from None
            finally:
                call.cancel()  # no-op when done; cancels the stream when left early
            await asyncio.sleep(backoff)

    def _open(
        self,
        addr: str,
        req: router_pb2.GenerateRequest,
        stream: _StreamState,
        timeout: float | None,
        metadata: tuple[tuple[str, str], ...],
    ):
        stub = self._stub(addr)
        if stream.received:
            resume = router_pb2.ResumeRequest(
                request=req,
                received_token_ids=stream.received,
                resume_token=stream.resume_token,
                received_text="".join(stream.texts),
            )
            return stub.Resume(resume, timeout=timeout, metadata=metadata + self._auth)
        return stub.Generate(req, timeout=timeout, metadata=metadata + self._auth)

    async def generate(self, *, timeout: float | None = None, **kwargs: Any) -> GenerationResult:
        start = time.perf_counter()
        events = [ev async for ev in self.generate_stream(timeout=timeout, **kwargs)]
        return collect(events, start)

    async def status(self, *, timeout: float | None = 10.0) -> ClusterStatus:
        """The cluster as the first router that answers sees it."""
        failures: dict[str, str] = {}
        error: PdserveClientError | None = None
        for addr in self.routers.in_order():
            try:
                resp = await self._stub(addr).Status(
                    router_pb2.StatusRequest(), timeout=timeout, metadata=self._auth
                )
            except grpc.RpcError as err:
                error = from_rpc_error(err)
                if not isinstance(error, Unavailable):
                    raise error from None
                self.routers.failed(addr)
                failures[addr] = error.message
                continue
            return _status(resp)
        assert error is not None
        raise self.routers.unavailable(error, failures) from None


class _StreamState:
    """What a stream received so far: what a resume on another router sends back."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self.texts: list[str] = []
        self.resume_token = ""
        self.finished = False  # the message with the finish reason arrived
        self.resumes = 0
        self.resume_deadline: float | None = None
        self.no_instance_at: set[str] = set()  # routers that had no instance to continue on

    def take(self, msg: router_pb2.GenerateResponse) -> GenerationEvent:
        if msg.resume_token:
            self.resume_token = msg.resume_token
        if msg.token_ids:  # the stream moves again: a later failure gets a fresh budget
            self.resumes, self.resume_deadline = 0, None
        self.finished = self.finished or bool(msg.finish_reason)
        self.received.extend(msg.token_ids)
        self.texts.append(msg.text)
        return GenerationEvent(
            request_id=msg.request_id,
            token_ids=list(msg.token_ids),
            text=msg.text,
            arrival_s=time.perf_counter(),
            server_ms=msg.server_ms,
            finish_reason=FINISH_REASONS.get(msg.finish_reason),
            usage=_usage(msg.usage) if msg.HasField("usage") else None,
        )
