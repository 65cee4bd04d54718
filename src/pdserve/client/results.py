"""Results the SDK returns: plain dataclasses, no protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

FINISH_REASONS = {1: "stop", 2: "length", 3: "abort"}  # pdserve.v1.FinishReason -> name
ROLES = {0: "unspecified", 1: "prefill", 2: "decode", 3: "colocated"}


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_ms: float = 0.0  # router-side
    e2e_ms: float = 0.0  # router-side
    stages: dict[str, float] = field(default_factory=dict)  # queue_ms, prefill_ms, ...
    prefill_instance: str = ""
    decode_instance: str = ""


@dataclass(frozen=True)
class GenerationEvent:
    request_id: str
    token_ids: list[int]  # new tokens in this message
    text: str  # text delta (complete characters)
    arrival_s: float  # time.perf_counter() when the message arrived
    server_ms: float = 0.0
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' on the last event
    usage: Usage | None = None  # on the last event


@dataclass
class GenerationResult:
    token_ids: list[int]
    text: str
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float  # client-measured: call start to first token
    tpot_ms: float  # client-measured: mean gap between tokens after the first
    e2e_ms: float  # client-measured: call start to last message
    token_times: list[float]  # perf_counter() arrival time of every token
    usage: Usage | None = None
    request_id: str = ""
    start_s: float = 0.0  # perf_counter() when the call started

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": self.token_ids,
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "ttft_ms": self.ttft_ms,
            "tpot_ms": self.tpot_ms,
            "e2e_ms": self.e2e_ms,
        }


@dataclass(frozen=True)
class InstanceInfo:
    instance_id: str
    address: str
    role: str
    state: str
    heartbeat_age_s: float
    load: dict[str, float]
    model_fingerprint: str = ""
    dtype: str = ""  # the dtype it serves (resolved)


@dataclass(frozen=True)
class RouterInfo:
    """A router replica as the answering router knows it (from the workers' reports)."""

    router_id: str
    address: str  # public gRPC HOST:PORT
    http_address: str = ""
    workers: int = 0  # registered workers that report it
    is_self: bool = False  # the replica that answered


@dataclass(frozen=True)
class ClusterStatus:
    instances: list[InstanceInfo]
    requests_total: int
    requests_running: int
    prompt_tokens_total: int
    cached_tokens_total: int
    model: str
    kvstore_address: str
    vocab_size: int = 0  # 0 = unknown (router without --model)
    context_length: int = 0
    block_size: int = 0
    dtype: str = ""  # what the registered workers serve (resolved; "a,b" if they differ)
    predictor: str = ""
    predictor_kendall_tau: float = 0.0  # running, over the router's recent finished requests
    predictor_observed: int = 0
    queue_waiting: int = 0
    checkpoint_dtype: str = ""  # config.json's torch_dtype; `dtype` is what the workers serve
    routers: list[RouterInfo] = field(default_factory=list)  # the replicas it knows of
    router_id: str = ""  # the replica that answered
    shared_store: str = ""  # "redis up" | "redis down: ..." | "" (a router alone)

    @property
    def cache_hit_rate(self) -> float:
        return (
            self.cached_tokens_total / self.prompt_tokens_total if self.prompt_tokens_total else 0.0
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "instances": [vars(i) for i in self.instances],
            "requests_total": self.requests_total,
            "requests_running": self.requests_running,
            "prompt_tokens_total": self.prompt_tokens_total,
            "cached_tokens_total": self.cached_tokens_total,
            "cache_hit_rate": self.cache_hit_rate,
            "vocab_size": self.vocab_size,
            "context_length": self.context_length,
            "block_size": self.block_size,
            "dtype": self.dtype,
            "checkpoint_dtype": self.checkpoint_dtype,
            "model": self.model,
            "kvstore_address": self.kvstore_address,
            "predictor": self.predictor,
            "predictor_kendall_tau": self.predictor_kendall_tau,
            "predictor_observed": self.predictor_observed,
            "queue_waiting": self.queue_waiting,
            "routers": [vars(r) for r in self.routers],
            "router_id": self.router_id,
            "shared_store": self.shared_store,
        }


def collect(events: list[GenerationEvent], start_s: float) -> GenerationResult:
    """Fold a finished stream into a GenerationResult (client-side timings)."""
    ids: list[int] = []
    times: list[float] = []
    for ev in events:
        ids.extend(ev.token_ids)
        times.extend([ev.arrival_s] * len(ev.token_ids))
    last = events[-1] if events else None
    usage = last.usage if last else None
    ttft = (times[0] - start_s) * 1000.0 if times else 0.0
    tpot = (times[-1] - times[0]) * 1000.0 / (len(times) - 1) if len(times) > 1 else 0.0
    return GenerationResult(
        token_ids=ids,
        text="".join(ev.text for ev in events),
        finish_reason=last.finish_reason if last else None,
        prompt_tokens=usage.prompt_tokens if usage else 0,
        cached_tokens=usage.cached_tokens if usage else 0,
        ttft_ms=ttft,
        tpot_ms=tpot,
        e2e_ms=((last.arrival_s - start_s) * 1000.0) if last else 0.0,
        token_times=times,
        usage=usage,
        request_id=last.request_id if last else "",
        start_s=start_s,
    )
