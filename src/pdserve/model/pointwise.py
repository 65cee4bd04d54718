"""The pointwise ops of a llama layer, two ways: torch ops, or fused bf16 kernels
(csrc/bf16_pointwise.cpp) on a CPU with AVX-512 (`PDSERVE_BF16_POINTWISE=0`: torch).

A llama layer runs four pointwise chains between its GEMMs: RMSNorm, the residual add, RoPE and
SiLU(gate) * up. In torch each is several ops, each a pass over memory and a temporary, and
SiLU runs a slow strided path over `chunk`'s view. In a bf16 prefill step of bench50m on one
core they took 12-18 % of the step (8 x 128 tokens: ~50 of ~390 ms; 32 x 128: ~300 of
~1,550 ms). The fused kernels do each chain in one pass and keep the chain's roundings (the
.cpp header): RoPE and the residual add are bit-identical to the torch chain, RMSNorm's sum
and SiLU's exp may differ in the last fp32 ulp before rounding to bf16.

Both ways work row by row, so both are batch-invariant. `pdserve.model.kernels.select_kernels`
picks the fused kernels for bf16 on CPU when they are built here and `PDSERVE_BF16_POINTWISE`
is not "0"; everything else (fp32: exact against transformers; GPU) gets torch; `ops(choice)`
gives the ops object of a choice. Build: `KERNEL` (`pdserve kernels build`).

The residual add is folded into the next norm (`add_norm`): a layer returns (x, delta) and the
next norm adds delta to x first, as vLLM's fused add-RMSNorm does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.avx512_bf16_linear import cpu_has_avx512_bf16
from pdserve.model.cpp_ext import CppKernel

_CSRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-ffp-contract=off"]
_BF16_FLAGS = ["-mavx512bf16"]  # one-instruction rounding to bf16 (csrc: rne_bits)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF numerics: normalise in float32, cast back, then scale by the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    y = F.rms_norm(x.float(), (x.shape[-1],), None, eps)
    return weight * y.to(x.dtype)


def rope_torch(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    # x: [T, heads, D]; cos / sin_signed: [T, 1, D] (HF's rotate_half, see llama.RotaryCache)
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * sin_signed


class TorchPointwise:
    """The torch chains (any dtype, any device)."""

    fused = False

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + delta, its RMSNorm); delta None: (x, its RMSNorm)."""
        if delta is not None:
            x = x + delta
        return x, rms_norm_torch(x, norm.weight, norm.eps)

    def rope_qk(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, D], k [T, Hkv, D] with RoPE, from qkv [T, (H + 2 Hkv) D]."""
        t = qkv.shape[0]
        qk = rope_torch(qkv[:, : (h + hkv) * d].view(t, -1, d), cos, sin)
        return qk[:, :h], qk[:, h:]

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """[T, 2I] -> silu(gate) * up [T, I]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedBf16Pointwise(TorchPointwise):
    """The same chains as fused bf16 CPU kernels (one pass each). The residual stream x is
    updated in place by add_norm."""

    fused = True

    def __init__(self, ext: Any) -> None:
        self._ext = ext

    @property
    def kernels(self) -> Any:
        """The compiled module (pdserve.model.direct_loop calls its entries directly)."""
        return self._ext

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor | None, norm: nn.Module
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if delta is None:
            return x, self._ext.rms_norm(x, norm.weight, norm.eps)
        return x, self._ext.add_rms_norm(x, delta, norm.weight, norm.eps)

    def rope_qk(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, h: int, hkv: int, d: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self._ext.rope_qk(qkv, cos.view(-1, d), sin.view(-1, d), h, hkv, d)
        return q, k  # contiguous, unlike the torch chain's views

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._ext.silu_mul(gate_up)


def cpu_has_avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _cpu_lacks(variant: str) -> str | None:
    if not cpu_has_avx512():
        return "no AVX-512 on this CPU"
    if variant == "avx512bf16" and not cpu_has_avx512_bf16():
        return "no AVX512-BF16 on this CPU"
    return None


KERNEL = CppKernel(
    "bf16_pointwise",
    _CSRC / "bf16_pointwise.cpp",
    {"avx512bf16": _FLAGS + _BF16_FLAGS, "avx512": _FLAGS},
    headers=[_CSRC / "avx512_math.h"],
    cpu_lacks=_cpu_lacks,
)


def load() -> Any | None:
    """The prebuilt kernels of this CPU's variant, or None (never compiles)."""
    return KERNEL.load()


def ops(choice: str) -> TorchPointwise:
    """The ops object of a `KernelSelection.pointwise` choice: "fused" or "torch"."""
    if choice != "fused":
        return TorchPointwise()
    ext = load()
    if ext is None:
        raise RuntimeError(f"fused pointwise chosen but {KERNEL.why_unavailable()}")
    return FusedBf16Pointwise(ext)
