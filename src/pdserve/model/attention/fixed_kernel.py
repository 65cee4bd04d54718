"""The fused batch-invariant CPU attention kernel (csrc/fixed_attn.cpp + fixed_attn_math.h)
and its loader.

`attend_paged` attends every query token of a step, prefill chunks and decodes alike, in ONE
call per layer, reading K/V straight from the paged cache `[num_blocks, 2, bs, Hkv, D]`
through the block table (bf16 or fp32; no gather, no upcast copy, no padding). Each query row
is reduced in an order fixed by its own position (keys from the window start to the row's
position, in order; see the .cpp header), so its bits do not depend on the batch, the
chunking, decode vs prefill or the thread count. The interface only needs "q, the paged cache,
block-table rows, query positions, context lengths, window, scale": it does not care how the
block table was built.

The math: fp32 (scores as FMA chains, P.V in fp32), except for a bf16 q and cache on a CPU with
AVX512-BF16, where q.k and P.V are bf16 dot products with fp32 accumulation (P rounded to bf16
for P.V, as flash attention does): 1.3-1.7x the fp32 kernel (docs/studies/cpu-kernels.md).
Either way a row's bits depend only on the row. The bits differ between the builds, so every
instance of a deployment must run on CPUs of one kind (as for the linear kernels).

Build: `pdserve.model.cpp_ext`, once, cached per ISA variant: "avx512bf16" (AVX-512 with
AVX512-BF16), "avx512" (without BF16; `PDSERVE_ATTN_KERNEL=avx512` forces it) or "scalar" (no
AVX-512; `PDSERVE_ATTN_KERNEL=scalar` forces it). `load()` tries once per process; if the
build fails (no compiler) or `PDSERVE_ATTN_KERNEL=0`, it returns None, logs why, and the torch
`fixed` path is used: the attention backend resolves this once and keeps the same path for its
whole life.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.logging import get_logger
from pdserve.model import cpp_ext
from pdserve.model.avx512_bf16_linear import cpu_has_avx512_bf16

_log = get_logger(__name__)
_SOURCE = Path(__file__).parent / "csrc" / "fixed_attn.cpp"
_BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
_BF16_FLAGS = ["-mavx512bf16"]  # q.k of a bf16 q and cache by VDPBF16PS (csrc: attend_*_dp)
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "ext": the module or None once tried; "build_s": seconds


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def variant_for(setting: str) -> str:
    """The build for this CPU and PDSERVE_ATTN_KERNEL: "avx512bf16" (bf16 q.k and P.V by
    VDPBF16PS), "avx512" (fp32 math; `=avx512` forces it on a BF16 CPU) or "scalar"."""
    if setting == "scalar" or not _avx512():
        return "scalar"
    return "avx512bf16" if cpu_has_avx512_bf16() and setting != "avx512" else "avx512"


def flags_for(variant: str) -> list[str]:
    """The compiler flags of one build variant (`variant_for`)."""
    extra = {"scalar": [], "avx512": _AVX512_FLAGS, "avx512bf16": _AVX512_FLAGS + _BF16_FLAGS}
    return _BASE_FLAGS + extra[variant]


def build(variant: str) -> Any:
    """The compiled module of one variant (cached per variant; raises when it cannot build)."""
    return cpp_ext.build("pdserve_fixed_attn", variant, _SOURCE, flags_for(variant))


def load() -> Any | None:
    """The compiled module, or None when it cannot be used (reason logged once)."""
    with _lock:
        if "ext" in _state:
            return _state["ext"]
        _state["ext"] = None
        setting = os.environ.get("PDSERVE_ATTN_KERNEL", "1")
        if setting == "0":
            _log.info("attention kernel off (PDSERVE_ATTN_KERNEL=0): torch fixed path")
            return None
        variant = variant_for(setting)
        t0 = time.perf_counter()
        try:
            ext = build(variant)
        except Exception as exc:  # no compiler, no ninja, headers missing: fall back
            _log.warning(
                "attention kernel unavailable: using the torch fixed path",
                error=f"{type(exc).__name__}: {exc}"[:500],
            )
            return None
        _state["build_s"] = time.perf_counter() - t0
        _state["ext"] = ext
        _log.info(
            "attention kernel loaded",
            variant=variant,
            vectorized=bool(ext.vectorized()),
            bf16_dot_products=bool(ext.dot_bf16()),
            load_s=round(_state["build_s"], 2),
        )
        return ext


def available() -> bool:
    return load() is not None


@dataclass
class KernelPlan:
    """One step's kernel arguments (built once per step, shared by all layers)."""

    k_rows: torch.Tensor  # [T] K row of each new token in the flat cache view
    v_rows: torch.Tensor  # [T] its V row (k_rows + block_size)
    block_size: int
    tables: torch.Tensor  # [B, W] int32 block ids per sequence (padded)
    tok_seq: torch.Tensor  # [T] int32 sequence (table row) of each token
    tok_pos: torch.Tensor  # [T] int32 position of each token
    ctx_lens: torch.Tensor  # [B] int32 context length incl. this step's tokens
    meta: Any  # the AttentionMetadata (for the torch path of a quantized cache)
    torch_plan: Any = None  # built on demand from meta by the backend


def plan(meta: Any) -> KernelPlan:
    """KernelPlan from AttentionMetadata (pdserve.model.attention.metadata). Once per step,
    on the decode hot path: the per-token arrays come from the host copies through numpy
    (microseconds per op, where a chain of small torch ops cost ~50 us per step)."""
    bs = meta.block_size
    device = meta.slot_mapping.device
    k_rows = meta.k_rows()
    qlens = np.asarray(meta.query_lens_cpu, dtype=np.int32)  # [B]
    ctx = np.asarray(meta.seq_lens_cpu, dtype=np.int32)  # [B]
    seq = np.repeat(np.arange(len(qlens), dtype=np.int32), qlens)  # [T] table row of a token
    # a sequence's new tokens end at its context length: pos = t - (first token - first pos)
    shift = np.repeat(np.cumsum(qlens, dtype=np.int32) - ctx, qlens)
    pos = np.arange(len(seq), dtype=np.int32) - shift  # [T]
    return KernelPlan(
        k_rows,
        k_rows + bs,
        bs,
        meta.block_tables.to(device=device, dtype=torch.int32).contiguous(),
        torch.from_numpy(seq).to(device),
        torch.from_numpy(pos).to(device),
        torch.from_numpy(ctx).to(device),
        meta,
    )


def attend_paged(
    q: torch.Tensor,  # [T, H, D] bf16 | fp32
    kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D] bf16 | fp32, contiguous
    tables: torch.Tensor,  # [B, W] int32
    tok_seq: torch.Tensor,  # [T] int32
    tok_pos: torch.Tensor,  # [T] int32
    ctx_lens: torch.Tensor,  # [B] int32
    window: int | None,
    scale: float,
    path: int = 0,  # 1: every token alone, 2: every run of tokens tiled (tests; same bits)
    k: torch.Tensor | None = None,  # [T, Hkv, D] the step's new keys, written first ...
    v: torch.Tensor | None = None,  # [T, Hkv, D] ... and values (rows contiguous)
    k_rows: torch.Tensor | None = None,  # [T] int64 K row of each in the flat cache (V: + bs)
) -> torch.Tensor:  # [T, H, D] in q's dtype
    ext = load()
    if ext is None:
        raise RuntimeError("the attention kernel is not available (see the log)")
    return ext.attend_paged(
        q.contiguous(),
        kv_cache,
        tables,
        tok_seq,
        tok_pos,
        ctx_lens,
        window or 0,
        scale,
        path,
        k=k,
        v=v,
        k_rows=k_rows,
    )
