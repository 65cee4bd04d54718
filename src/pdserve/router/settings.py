"""RouterSettings: the router's settings in groups (`settings.admission.max_queue`), with
flat flags and environment names (`--max-queue`, `PDSERVE_MAX_QUEUE`): pdserve.config."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdserve.config import ServiceSettings, SettingsGroup

from .scheduling.overload_queue import DEFAULT_MAX_WAIT_S


class InputLimitSettings(SettingsGroup):
    """Bounded input on the public plane: refused with INVALID_ARGUMENT (HTTP 400/413)
    before any real work."""

    max_request_bytes: int = Field(
        16 << 20,
        ge=1024,
        description="largest request on the public plane, bytes: a gRPC message, or an "
        "HTTP body (413 when larger, refused before it is read whole)",
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


class KeySettings(SettingsGroup):
    """API keys of the public plane and each key's default limits (frontdoor/auth.py)."""

    api_key: list[str] = Field(
        default_factory=list,
        description="accepted API key (repeatable; none and no keys file = open API); "
        "prefer --api-keys-file: flags show up in ps",
    )
    api_keys_file: str | None = Field(
        None, description='JSON keys file: {"keys": [{"name", "key", "max_concurrent", ...}]}'
    )
    key_max_concurrent: int = Field(
        0, ge=0, description="default concurrent streams per API key (0 = unlimited)"
    )
    key_tokens_per_minute: int = Field(
        0, ge=0, description="default tokens (prompt + completion) per minute per key (0 = off)"
    )


class AdmissionSettings(SettingsGroup):
    """The one admission stage (scheduling/admission.py): the router's running limit,
    its bounded ordered queue, and how long a request waits for worker capacity. By
    default the running limit follows the workers' batch slots (`--running-per-batch-slot`
    x the max_num_seqs the serving decode or colocated instances report), so a request the
    cluster cannot run soon waits in the router before any work is done; `--max-running`
    or `--queue-max-running-per-decode` replace that with a fixed limit."""

    max_running: int = Field(
        0, ge=0, description="requests the router runs at once; more wait (0 = unlimited)"
    )
    queue_max_running_per_decode: int = Field(
        0,
        ge=0,
        description="router overload queue: requests running per decode (or colocated) "
        "instance before new ones wait in the router (0 = no router queue)",
    )
    running_per_batch_slot: float = Field(
        2.0,
        ge=0,
        description="with neither limit above: requests running at once per batch slot (the "
        "max_num_seqs each serving decode or colocated instance reports); more wait in the "
        "router (0 = no such limit)",
    )
    max_queue: int = Field(
        4096, ge=0, description="requests waiting for a slot before 429 (RESOURCE_EXHAUSTED)"
    )
    queue_timeout_s: float = Field(
        600.0, gt=0, description="longest wait for a slot before RESOURCE_EXHAUSTED, seconds"
    )
    queue_order: Literal["fcfs", "sjf"] = Field(
        "sjf", description="overload queue order: sjf (shortest predicted first, aged) or fcfs"
    )
    queue_aging_tokens_per_s: float = Field(
        64.0, ge=0, description="sjf aging: a waiter's predicted length shrinks this much per s"
    )
    queue_max_wait_s: float = Field(
        DEFAULT_MAX_WAIT_S,
        gt=0,
        description="a waiter this old goes before everyone else, seconds (below "
        "--queue-timeout-s, so that it matters)",
    )
    queue_max_bypass: float = Field(
        2.0,
        ge=0,
        description="sjf: a waiter goes first once this many x its FCFS turn admissions "
        "passed since it arrived (0 = no bound)",
    )
    kv_queue_timeout_s: float = Field(
        30.0, ge=0, description="wait for free decode KV blocks before RESOURCE_EXHAUSTED, s"
    )


class PlacementSettings(SettingsGroup):
    """Where a request runs (scheduling/policies.py) and how much decode KV it reserves.
    Defaults by docs/studies/scheduling-policies.md, "The defaults":
    prefix_aware wins over least_loaded on the Mooncake trace (with and without the kvstore);
    predicted decode placement and KV headroom win nowhere, simulated or emulated, so both
    stay off; placement by predicted length wins on decode pools of mixed memory (mean E2E
    -10 to -12 % on three workloads, confirmed emulated: docs/studies/where-disagg-wins.md)
    and leaves a uniform pool to the count order, so it is on."""

    policy: Literal["round_robin", "least_loaded", "prefix_aware"] = Field(
        "prefix_aware",
        description="placement policy (prefix_aware: least loaded, preferring the prefill "
        "instance that holds the prompt's prefix)",
    )
    session_affinity: bool = Field(
        True, description="same session_id -> same prefill/colocated instance while it lives"
    )
    decode_placement: Literal["count", "predicted", "length"] = Field(
        "length",
        description="decode placement: count (the policy's request counts), predicted "
        "(least predicted KV footprint over the request's predicted lifetime) or length "
        "(for decodes of mixed memory: answers predicted long to those with the most KV; "
        "a pool of one memory size is placed by count). Default length: mean E2E "
        "-12.4 +- 6.0 % simulated (Azure, 5 seeds, 95 % CI), -14.0 +- 11.1 % emulated "
        "(docs/RESULTS.md, 'The evidence behind each default')",
    )
    length_routing_tokens: int = Field(
        0,
        ge=0,
        description="--decode-placement length: a predicted answer (p50) of this many tokens "
        "or more goes to the decodes with the most KV; 0 = the longest share of requests "
        "(their share of the pool's KV), ranked among recent predictions",
    )
    reserve_max_tokens: int = Field(
        0,
        ge=0,
        description="decode KV headroom reserved for the predicted output (p90), at most "
        "(0 = none: the decode grows the block table as it goes)",
    )


class LengthSettings(SettingsGroup):
    """The output-length predictor (scheduling/predictor/, scheduling/length.py). It
    runs per request only when something reads it: an SJF queue, predicted decode
    placement, KV headroom, or the flip controller."""

    predictor: Literal["ewma", "online"] = Field(
        "online",
        description="output-length predictor: ewma (one number for all) or online (text "
        "model + prefix/session memory + per-model calibration, learning from finished "
        "requests)",
    )
    predictor_alpha: float = Field(
        0.2,
        gt=0,
        le=1,
        description="EWMA weight of the output-length predictor (only with --predictor ewma)",
    )
    predictor_initial: float = Field(
        64.0, gt=0, description="predicted output length before any request finished"
    )
    predictor_path: str | None = Field(
        None,
        description="length model artifact DIR (pdserve predictor train); default: the "
        "shipped one; 'none' = no text model (online memory only)",
    )
    predictor_oracle: bool = Field(
        False,
        description="BENCHMARK ONLY: trust the true output length a request carries in "
        "its pdserve-oracle-tokens metadata",
    )
    predictor_use_max_tokens: bool = Field(
        True,
        description="let the predictor clamp to max_tokens (off for benchmarks whose "
        "max_tokens is the true length)",
    )

    @model_validator(mode="after")
    def _alpha_is_ewma_only(self) -> LengthSettings:
        if "predictor_alpha" in self.model_fields_set and self.predictor != "ewma":
            raise ValueError(
                f"--predictor-alpha sets the EWMA predictor's weight; it does nothing with "
                f"--predictor {self.predictor} (add --predictor ewma, or drop it)"
            )
        return self


class LifecycleSettings(SettingsGroup):
    """Deadlines, retries and migration of one request across workers (lifecycle/)."""

    reserve_deadline_s: float = Field(
        60.0,
        gt=0,
        description="longest wait for a Decode stream's ticket (the reservation) from a decode "
        "that heartbeats, seconds (one that stops heartbeating is given up at once)",
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
    max_migrations: int = Field(
        3,
        ge=0,
        description="times a stream may move to another worker when its worker dies mid-stream "
        "(0 = never: the client gets UNAVAILABLE)",
    )
    migration_wait_s: float = Field(
        10.0, ge=0, description="a moving stream waits this long for a free decode instance, s"
    )
    lease_s: float = Field(
        0.0, ge=0, description="KV reservation lease, seconds (0 = worker default)"
    )


class FlipSettings(SettingsGroup):
    """The flip controller (flip/): moves workers between the prefill and decode pools.
    Off by default (docs/studies/scheduling-policies.md, "The defaults"): on a prefill-heavy to
    decode-heavy shift it raises goodput by 44 % but mean E2E by 9 %, more than the 5 % loss
    the defaults rule allows; turn it on where SLO attainment matters more than latency."""

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


class ReplicaSettings(SettingsGroup):
    """Router replicas (docs/ARCHITECTURE.md, "Router replicas"): each learns the workers
    from the workers; what they must agree on (per-key limits, who flips) goes through a
    shared Redis; streams resume on any replica with a resume token."""

    router_id: str | None = Field(
        None, description="this replica's id in Status and worker reports (default: instance id)"
    )
    advertise_host: str | None = Field(
        None,
        description="host clients should dial for this replica (Status lists it; default: "
        "--host, or this host's IP when bound to a wildcard)",
    )
    redis_url: str | None = Field(
        None,
        description="shared store of the replicas (redis://HOST:PORT/DB): per-key limits "
        "across replicas and one flip leader; none = this router is alone",
    )
    key_lease_ttl_s: float = Field(
        10.0, gt=0, description="a per-key stream lease lives this long unless renewed, s"
    )
    leader_ttl_s: float = Field(
        10.0, gt=0, description="the flip leader's lock lives this long unless renewed, s"
    )
    resume_secret_file: str | None = Field(
        None,
        description="file with the secret (>= 16 bytes) that signs resume tokens, the same "
        "on every replica (default: derived from the router's TLS key)",
    )
    resume_token_ttl_s: float = Field(
        3600.0, gt=0, description="how long a stream's resume token stays valid, seconds"
    )


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
    model: str | None = Field(
        None, description="model directory (tokenizer + config.json); none = token ids only"
    )
    heartbeat_interval_s: float = Field(
        1.0, gt=0, description="heartbeat interval handed to workers, seconds"
    )
    heartbeat_timeout_s: float = Field(
        3.0, gt=0, description="drop an instance silent for this long, seconds"
    )
    kvstore_addr: str | None = Field(
        None, description="HOST:PORT of the kvstore, handed to workers at registration"
    )
    use_kvstore: bool = Field(True, description="ask workers to use the kvstore when configured")
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="OpenAI-compatible HTTP API port (0 = pick a free port; unset = off)",
    )
    limits: InputLimitSettings = Field(default_factory=InputLimitSettings)
    keys: KeySettings = Field(default_factory=KeySettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    placement: PlacementSettings = Field(default_factory=PlacementSettings)
    length: LengthSettings = Field(default_factory=LengthSettings)
    lifecycle: LifecycleSettings = Field(default_factory=LifecycleSettings)
    flip: FlipSettings = Field(default_factory=FlipSettings)
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
