"""EngineConfig: what one engine is built with (model, dtype, KV pool, batching limits)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pdserve.model.kernel_settings import KernelSettings


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | Path
    dtype: str = "auto"  # float32 | bfloat16 | float16 | auto (loader.auto_dtype: per device)
    device: str = "cpu"
    num_blocks: int | None = None  # wins over kv_cache_bytes
    kv_cache_bytes: int | None = None  # default: 1 GiB, capped at what max_num_seqs can use
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    chunked_prefill: bool = True  # False: vLLM <= 0.3 (prefill priority, whole prompts)
    enable_prefix_caching: bool = True
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    seed: int | None = None  # generator for unseeded random sampling
    batch_invariant: bool = True  # tokens independent of batch/chunking/path (runner doc)
    kv_dtype: str | None = None  # None = the weights' dtype; "int8" | "fp8_e4m3": kv/quant.py
    # layered specs with sliding layers (Gemma 4): the sliding layers get their own block
    # pool whose blocks before the window are freed (kv/window_group.py); False = one pool
    window_pool: bool = True
    window_blocks: int | None = None  # the window pool's size; default: see _num_blocks
    # the kernel switches (pdserve.model.kernel_settings); None: the PDSERVE_* environment
    kernels: KernelSettings | None = None
