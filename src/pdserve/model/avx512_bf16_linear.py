"""A batch-invariant bf16 linear for CPUs with AVX512-BF16 and no AMX
(csrc/avx512_bf16_linear.cpp) and its loader.

Why it exists: on such a CPU oneDNN's packed bf16 linear is NOT reliably row-invariant: on
an AMD EPYC (Zen 4) a 2048 x 512 packed linear (bench50m's MLP down
projection) gives row 0 other bits alone than among 2-300 rows, and 25 of 300 rows of a call
other bits than alone (tests/unit/test_avx512_bf16_linear.py probes it); 512-input shapes were
invariant. It is also slow for decode: a batch-1 decode step spends ~77 % of its time in it,
streaming the weights at ~40-60 % of the read bandwidth. This kernel is invariant by
construction: each output element is one fp32 accumulator fed k pair by k pair in order
(VDPBF16PS), then bias in fp32 and one rounding to bf16, so a row's bits do not depend on the
row count, its position or the thread count (threads split the output columns). The one-row
path streams the weight front to back; the many-row path blocks 6 rows x 64 columns in
registers, which changes no element's k order.

`Avx512Bf16Linear` holds the weight in the kernel's panel layout (packed once at load; the
plain weight is dropped; `pack_all` packs a model's weights back to back). On a CPU with AMX
`pdserve.model.amx_linear` is used instead. `Avx512Bf16SiluMulLinear` is a gate_up layer with
the MLP's silu(gate) * up computed in the product's epilogue (same bits as the two steps).

Serving it: `pdserve.model.kernels.select_kernels` chooses it for an invariant bf16 engine on
such a CPU unless `PDSERVE_AVX512_BF16_LINEAR=0` (oneDNN then, and the reason says bf16 is not
invariant here). Against oneDNN in bench50m's engine: decode 1.1-2.1x faster, prefill at
parity (docs/studies/cpu-kernels.md "The linear kernels").

Build: `pdserve.model.cpp_ext.CppKernel` (`KERNEL`), by `pdserve kernels build`. `load()` returns
None (and `KERNEL.why_unavailable()` says why) when the CPU has no AVX512-BF16 or it is not
built (no compiler).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Self

import torch
from torch import nn

from pdserve.model.cpp_ext import CppKernel
from pdserve.model.cpu import CpuFeatures

_CSRC = Path(__file__).parent / "csrc"
SERVED_ELSEWHERE = "not served on a CPU with AMX (amx_linear is; `--all` builds it)"
_FLAGS = ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16"]


def cpu_has_avx512_bf16() -> bool:
    return bool(getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)())


KERNEL = CppKernel(
    "avx512_bf16_linear",
    _CSRC / "avx512_bf16_linear.cpp",
    {"avx512bf16": _FLAGS},
    headers=[_CSRC / "avx512_math.h"],
    cpu_lacks=lambda variant: None if cpu_has_avx512_bf16() else "no AVX512-BF16 on this CPU",
    not_served=lambda: SERVED_ELSEWHERE if CpuFeatures.detect().amx else None,
)


def load() -> Any | None:
    """The prebuilt module, or None (never compiles)."""
    return KERNEL.load()


def available() -> bool:
    return load() is not None


def _loaded() -> Any:
    ext = load()
    if ext is None:
        raise RuntimeError(
            f"the AVX512-BF16 linear kernel is not available: {KERNEL.why_unavailable()}"
        )
    return ext


def packed_numel(n: int, k: int) -> int:
    """Elements of a packed [N, K] weight: ceil(N/64) * ceil(K/2) * 128."""
    return -(-n // 64) * -(-k // 2) * 128


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> the kernel's panel layout [ceil(N/64), ceil(K/2), 64, 2] bf16."""
    return _loaded().pack(weight.detach().contiguous())


def pack_all(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Several weights packed back to back, in the given order, into one storage (huge pages:
    csrc). A decode step that runs them in this order streams one run of memory, which the
    hardware prefetcher follows across weights; a weight of less than 2 MiB alone would get
    4 KiB pages. Each result is `pack`'s layout (a view; the storage lives while one does)."""
    ext = _loaded()
    sizes = [packed_numel(*w.shape) for w in weights]
    arena = ext.alloc(sum(sizes))
    out, offset = [], 0
    for w, size in zip(weights, sizes, strict=True):
        out.append(ext.pack(w.detach().contiguous(), arena[offset : offset + size]))
        offset += size
    return out


GATE_UP_HALF = 32  # gate (or up) columns per 64-column panel of a fused gate_up weight


def gate_up_order(t: torch.Tensor) -> torch.Tensor:
    """A gate_up weight [2I, K] (or bias [2I]) -> [64 Np, K] ([64 Np]), Np = ceil(I/32): panel p
    holds gate rows 32p..32p+31, then the same up rows (zeros past I), so that one panel's
    epilogue has the gate and the up of the same 32 columns (`linear_silu_mul`)."""
    i, rest = t.shape[0] // 2, tuple(t.shape[1:])
    np_ = -(-i // GATE_UP_HALF)
    out = t.new_zeros((np_, 2, GATE_UP_HALF, *rest))
    for half, part in enumerate((t[:i], t[i:])):
        padded = t.new_zeros((np_ * GATE_UP_HALF, *rest))
        padded[:i] = part
        out[:, half] = padded.view((np_, GATE_UP_HALF, *rest))
    return out.view((np_ * 2 * GATE_UP_HALF, *rest))


def _rows(
    op: Any, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """A kernel entry `op` (x [M, K], packed, bias, n) -> [M, n] applied to x [..., K]."""
    if x.dim() == 2:  # the model's case: no reshape / view per call (decode hot path)
        return op(x, packed, bias, n)
    return op(x.reshape(-1, x.shape[-1]), packed, bias, n).view(*x.shape[:-1], n)


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x [..., K] bf16 @ W.T (+ bias) -> [..., n] bf16, W packed by `pack`."""
    return _rows(_loaded().linear, x, packed, bias, n)


class Avx512Bf16Linear(nn.Module):
    """y = x @ W.T + b with W in the AVX512-BF16 kernel's panel layout. bf16, inference only."""

    _kernel = "linear"  # the kernel entry forward calls

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        packed: torch.Tensor | None = None,
    ) -> None:
        """packed: `weight` already packed (`pack_all`, rows in `_order`), else packed here."""
        super().__init__()
        n, self.in_features = weight.shape
        self.out_features = self._outputs(n)
        self.packed = pack(self._order(weight)) if packed is None else packed
        self.bias = None if bias is None else self._order(bias.detach().float()).contiguous()

    @staticmethod
    def _order(t: torch.Tensor) -> torch.Tensor:
        """W's rows (and b's) in the order the kernel's panels hold them."""
        return t

    @staticmethod
    def _outputs(n: int) -> int:
        """Output features of a weight of n rows."""
        return n

    @classmethod
    def from_linear(cls, lin: nn.Linear, packed: torch.Tensor | None = None) -> Self:
        return cls(lin.weight, lin.bias, packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rows(getattr(_loaded(), self._kernel), x, self.packed, self.bias, self.out_features)

    def kernel_entry(self) -> tuple[Any, torch.Tensor, torch.Tensor | None, int]:
        """(fn, packed, bias, n): `fn(x [M, K], packed, bias, n)` is forward of a 2-d x
        (pdserve.model.direct_loop)."""
        return getattr(_loaded(), self._kernel), self.packed, self.bias, self.out_features

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


class Avx512Bf16SiluMulLinear(Avx512Bf16Linear):
    """silu(x @ W_gate.T + b_gate) * (x @ W_up.T + b_up) [..., I] of a gate_up layer (W [2I, K],
    gate rows first), in one kernel call: the silu_mul runs in the product's epilogue, on the
    gate and up values the plain linear would have stored, so a row's bits equal
    `silu_mul(Avx512Bf16Linear(W)(x))`. Saves the [T, 2I] intermediate and a pass over it.
    bf16, inference only."""

    fuses_silu_mul = True  # its output is already silu(gate) * up (DecoderLayer.mlp)
    _kernel = "linear_silu_mul"
    _order = staticmethod(gate_up_order)

    @staticmethod
    def _outputs(n: int) -> int:
        if n % 2:
            raise ValueError(f"a gate_up weight has 2I rows, got {n}")
        return n // 2

    def extra_repr(self) -> str:
        return super().extra_repr() + " (silu(gate) * up)"
