"""RouterSettings: env PDSERVE_<FIELD>, flags --<field-name> on top."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve.config import ServiceSettings


class RouterSettings(ServiceSettings):
    """pdserve router: the public endpoint (Router) and the worker registry (Registry)."""

    port: int = Field(
        50051, ge=0, le=65535, description="public gRPC port: the client API (0 = any free port)"
    )
    internal_port: int = Field(
        50061, ge=0, le=65535,
        description="internal gRPC port: the worker registry, mutual TLS (0 = any free port)",
    )  # fmt: skip
    max_instances_per_identity: int = Field(
        0, ge=0,
        description="most live instances one worker certificate may register (0 = no cap; "
        "use 1 when every worker has its own certificate)",
    )  # fmt: skip
    # -- bounded input (public plane): refused with INVALID_ARGUMENT before any real work
    max_request_bytes: int = Field(
        16 << 20, ge=1024, description="largest request message on the public port, bytes"
    )
    max_prompt_chars: int = Field(
        1_000_000, ge=1, description="longest text prompt (all chat messages together), chars"
    )
    max_chat_messages: int = Field(256, ge=1, description="most messages in a chat prompt")
    max_stop_strings: int = Field(16, ge=0, description="most stop strings per request")
    max_stop_chars: int = Field(256, ge=1, description="longest stop string, characters")
    max_prompt_tokens: int = Field(
        0, ge=0, description="most prompt tokens (0 = the model's context length)"
    )
    model: str | None = Field(
        None, description="model directory (tokenizer + config.json); none = token ids only"
    )
    policy: Literal["round_robin", "least_loaded", "prefix_aware"] = Field(
        "prefix_aware",
        description="placement policy (prefix_aware: least loaded, preferring the prefill "
        "instance that holds the prompt's prefix)",
    )
    session_affinity: bool = Field(
        True, description="same session_id -> same prefill/colocated instance while it lives"
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="heartbeat interval handed to workers, seconds"
    )
    heartbeat_timeout_s: float = Field(
        3.0, gt=0, description="drop an instance silent for this long, seconds"
    )
    reserve_deadline_s: float = Field(5.0, gt=0, description="Reserve RPC deadline, seconds")
    kv_queue_timeout_s: float = Field(
        30.0, ge=0, description="wait for free decode KV blocks before RESOURCE_EXHAUSTED, s"
    )
    prefill_deadline_s: float = Field(120.0, gt=0, description="Prefill RPC deadline, seconds")
    first_token_deadline_s: float = Field(
        120.0, gt=0, description="wait for the first chunk of a Decode/Generate stream, seconds"
    )
    decode_idle_deadline_s: float = Field(
        60.0, gt=0, description="longest gap between two chunks of a stream, seconds"
    )
    abort_deadline_s: float = Field(2.0, gt=0, description="Abort RPC deadline, seconds")
    max_prefill_attempts: int = Field(
        3, ge=1, description="prefill tries per request (other instances) before UNAVAILABLE"
    )
    kvstore_addr: str | None = Field(
        None, description="HOST:PORT of the kvstore, handed to workers at registration"
    )
    use_kvstore: bool = Field(True, description="ask workers to use the kvstore when configured")
    lease_s: float = Field(
        0.0, ge=0, description="KV reservation lease, seconds (0 = worker default)"
    )
    predictor_alpha: float = Field(
        0.2, gt=0, le=1, description="EWMA weight of the output-length predictor"
    )
    predictor_initial: float = Field(
        64.0, gt=0, description="predicted output length before any request finished"
    )
    # -- flip controller (flip.py): move workers between the prefill and decode pools
    flip_enabled: bool = Field(
        False, description="let the router flip workers between prefill and decode"
    )
    flip_interval_s: float = Field(2.0, gt=0, description="flip controller period, seconds")
    flip_ticks: int = Field(
        3, ge=1, description="consecutive ticks a pool must stay starved before a flip"
    )
    flip_cooldown_s: float = Field(30.0, ge=0, description="no flip this soon after the last one")
    flip_ratio: float = Field(
        3.0, ge=1, description="starved pool's pressure / the other pool's, at least"
    )
    flip_starved: float = Field(
        1.0, gt=0, description="pressure at which a pool counts as starved (1 = full)"
    )
    flip_prefill_tokens: float = Field(
        2048.0, gt=0, description="prompt tokens in flight per prefill instance = pressure 1"
    )
    flip_decode_seqs: float = Field(
        32.0, gt=0, description="running sequences per decode instance = pressure 1"
    )
    flip_timeout_s: float = Field(
        120.0, gt=0, description="SetRole deadline (the worker drains first), seconds"
    )
