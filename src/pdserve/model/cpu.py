"""What this CPU runs natively: the facts the kernel choices depend on (the ISA extensions,
and whether this torch build packs a linear's weights for oneDNN in a dtype)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuFeatures:
    avx512: bool  # AVX-512 (F, BW, VL, DQ) as ATen dispatches it
    avx512_bf16: bool  # VDPBF16PS, VCVTNEPS2BF16
    amx: bool  # AMX tiles with bf16 (Sapphire Rapids and later)

    @staticmethod
    @functools.cache
    def detect() -> CpuFeatures:
        cpu = torch.cpu
        return CpuFeatures(
            avx512=torch.backends.cpu.get_cpu_capability().startswith("AVX512"),
            avx512_bf16=bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()),
            amx=bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)()),
        )

    def describe(self) -> str:
        names = [n for n, on in (("AVX-512", self.avx512), ("AVX512-BF16", self.avx512_bf16),
                                 ("AMX", self.amx)) if on]  # fmt: skip
        return ", ".join(names) or "no AVX-512"


# the batch size oneDNN tunes a packed layout for; any row count works at run time
BATCH_HINT = 64


@functools.cache
def packing_supported(dtype: torch.dtype) -> bool:
    """True when this torch build and CPU can run a packed linear in `dtype` (tried once)."""
    if dtype not in (torch.float32, torch.bfloat16) or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    try:
        w = torch.ones(8, 4, dtype=dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, BATCH_HINT)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(2, 4, dtype=dtype), packed, None,
                                               "none", [], "")  # fmt: skip
    except (RuntimeError, AttributeError):
        return False
    return bool((y.float() == 4.0).all())
