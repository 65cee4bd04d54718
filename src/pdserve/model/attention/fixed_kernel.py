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

Build: `pdserve.model.cpp_ext.CppKernel` (`KERNEL`), one module per ISA variant: "avx512bf16"
(AVX-512 with AVX512-BF16), "avx512" (without BF16; `PDSERVE_ATTN_KERNEL=avx512` forces it) or
"scalar" (no AVX-512; `PDSERVE_ATTN_KERNEL=scalar` forces it), built by `pdserve kernels build`.
`pdserve.model.kernels.select_kernels` picks the variant (or the torch `fixed` path, and says
why); the attention backend keeps its choice for its whole life.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pdserve.model.avx512_bf16_linear import cpu_has_avx512_bf16
from pdserve.model.cpp_ext import CppKernel
from pdserve.model.kernel_settings import KernelSettings

_CSRC = Path(__file__).parent / "csrc"
_BASE_FLAGS = ["-O3", "-ffp-contract=off", "-fno-fast-math"]
_AVX512_FLAGS = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"]
_BF16_FLAGS = ["-mavx512bf16"]  # q.k of a bf16 q and cache by VDPBF16PS (csrc: attend_*_dp)
_FLAGS = {
    "avx512bf16": _BASE_FLAGS + _AVX512_FLAGS + _BF16_FLAGS,
    "avx512": _BASE_FLAGS + _AVX512_FLAGS,
    "scalar": _BASE_FLAGS,
}


def _avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _cpu_lacks(variant: str) -> str | None:
    if variant != "scalar" and not _avx512():
        return "no AVX-512 on this CPU"
    if variant == "avx512bf16" and not cpu_has_avx512_bf16():
        return "no AVX512-BF16 on this CPU"
    return None


KERNEL = CppKernel(
    "fixed_attn",
    _CSRC / "fixed_attn.cpp",
    _FLAGS,
    headers=[_CSRC / "fixed_attn_math.h", _CSRC.parents[1] / "csrc" / "avx512_math.h"],
    cpu_lacks=_cpu_lacks,
)


def variant_for(setting: str) -> str:
    """The build for this CPU and an `attn_kernel` setting (auto | avx512 | scalar; also the
    former "1"): "avx512bf16" (bf16 q.k and P.V by VDPBF16PS), "avx512" (fp32 math; `avx512`
    forces it on a BF16 CPU) or "scalar"."""
    if setting == "scalar" or not _avx512():
        return "scalar"
    return "avx512bf16" if cpu_has_avx512_bf16() and setting != "avx512" else "avx512"


def flags_for(variant: str) -> list[str]:
    """The compiler flags of one build variant (`variant_for`)."""
    return list(_FLAGS[variant])


def served_variant() -> str | None:
    """The variant this process's settings serve (`PDSERVE_ATTN_KERNEL`), None when off."""
    setting = KernelSettings.from_env().attn_kernel
    return None if setting == "off" else variant_for(setting)


def load(variant: str | None = None) -> Any | None:
    """The prebuilt module of `variant` (default: `served_variant()`), or None (never
    compiles; `KERNEL.why_unavailable` says why)."""
    variant = variant or served_variant()
    return None if variant is None else KERNEL.load(variant)


def available(variant: str | None = None) -> bool:
    return load(variant) is not None


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
    ext: Any = None,  # the module of the variant to run (default: `load()`)
) -> torch.Tensor:  # [T, H, D] in q's dtype
    ext = ext or load()
    if ext is None:
        raise RuntimeError(f"the attention kernel is not available: {KERNEL.why_unavailable()}")
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
