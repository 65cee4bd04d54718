"""Worker settings (prefill, decode and colocated roles share one worker)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdserve.config import ServiceSettings
from pdserve.model.kernel_settings import KernelSettings

RoleName = Literal["prefill", "decode", "colocated"]


class WorkerSettings(ServiceSettings):
    model: str | None = Field(None, description="checkpoint directory (none = built-in tiny)")
    role: RoleName = Field("colocated", description="starting role; the router may flip it")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="weights and KV dtype (auto: bfloat16 where the device runs it faster)"
    )
    kv_dtype: Literal["auto", "int8", "fp8_e4m3"] = Field(
        "auto",
        description="KV cache dtype (auto: the weights'); int8 / fp8_e4m3 store KV quantized "
        "with per-block per-head scales, in the cache, on the wire and in the kvstore. Every "
        "worker of a cluster must use the same (the KV fingerprint includes it)",
    )
    device: str = Field("cpu", description="torch device (cpu, cuda, cuda:1)")
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_blocks: int | None = Field(None, ge=2, description="KV blocks (wins over kv_cache_bytes)")
    kv_cache_bytes: int | None = Field(None, ge=1, description="KV cache budget in bytes")
    max_num_batched_tokens: int = Field(512, ge=16, description="token budget of one step")
    max_num_seqs: int = Field(64, ge=1, description="most sequences in one batch")
    chunked_prefill: bool = Field(
        True,
        description="chunk long prompts and mix them with decodes (off: vLLM <= 0.3, a step "
        "prefills whole prompts first or decodes)",
    )
    enable_prefix_caching: bool = Field(True, description="reuse full blocks across requests")
    window_pool: bool = Field(
        True,
        description="models with sliding and full layers of different shapes (Gemma 4): the "
        "sliding layers keep their own block pool and free blocks that leave the window; "
        "--no-window-pool: one pool for every layer",
    )
    window_blocks: int | None = Field(
        None,
        ge=1,
        description="blocks of the sliding layers' pool (default: as many as --num-blocks; "
        "with --kv-cache-bytes, max_num_seqs windows plus one step, first)",
    )
    threads: int = Field(0, ge=0, description="torch intra-op threads (0 = torch default)")
    step_log: str | None = Field(
        None,
        description="directory to log every engine step into (one JSON line per step: its "
        "start, wall and CPU seconds and what it held; off by default)",
    )
    batch_invariant: bool = Field(
        True,
        description="a request's tokens do not depend on its batch, chunking or path; "
        "--no-batch-invariant: faster SDPA attention, tokens may change with the batch",
    )
    kernels: KernelSettings = Field(default_factory=KernelSettings)
    advertise_host: str | None = Field(
        None, description="host the router should dial (default: host, or this host's IP)"
    )
    heartbeat_interval_s: float = Field(1.0, gt=0, description="load report period")
    router_discovery: Literal["static", "dns"] = Field(
        "static",
        description="static: register with each --router-addr entry; dns: resolve each "
        "entry's host every --router-resolve-s and register with every address it "
        "resolves to (router replicas behind a headless Service)",
    )
    router_resolve_s: float = Field(
        5.0, gt=0, description="with --router-discovery dns: resolve the routers this often, s"
    )
    lease_s: float = Field(
        120.0,
        gt=0,
        description="default lease of a KV reservation; must cover the prefill's queueing "
        "(the router's prefill deadline), or an overloaded prefill pushes to released tags",
    )
    max_lease_s: float = Field(
        600.0, gt=0, description="longest KV reservation lease a Decode stream may ask for, seconds"
    )
    transfer_timeout_s: float = Field(20.0, gt=0, description="timeout of one KV send")
    kvstore_addr: str | None = Field(
        None, description="kvstore HOST:PORT (default: the one the router hands out)"
    )
    kvstore_timeout_s: float = Field(2.0, gt=0, description="deadline of kvstore calls")
    # -- the emulated engine (pdserve.emulate): only the forward pass is modelled
    emulate: str | None = Field(
        None,
        description="emulate this accelerator (h100, h200, a100, l40s, mi300x; NAMExTP): "
        "steps last as long as the cost model says, no torch",
    )
    emulate_model_config: str | None = Field(
        None,
        description="(--model-config) emulated model: built-in name (llama3-8b, llama3-70b, "
        "qwen2.5-32b), config.json or directory; default: --model's config.json",
    )
    emulate_profile: str | None = Field(
        None, description="(--profile) `pdserve profile` JSON: its costs instead of the roofline"
    )
    time_scale: float = Field(
        1.0, gt=0, description="emulation: wall seconds per modelled second (>1: slower)"
    )
    emulate_network: str = Field(
        "nvlink", description="emulation: KV link (costmodel.hardware.NETWORKS)"
    )
    emulate_dtype: str = Field("bfloat16", description="emulation: modelled serving dtype")
    emulate_kv_layers: int = Field(
        1, ge=1, le=64, description="emulation: KV messages per push (wire layers)"
    )
