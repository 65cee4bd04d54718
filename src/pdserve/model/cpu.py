"""What this CPU runs natively: the facts the kernel choices depend on."""

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
