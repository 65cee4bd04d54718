"""A batch-invariant bf16 linear for CPUs with Intel AMX (csrc/amx_linear.cpp) and its loader.

Why it exists: on a CPU with AMX, oneDNN chooses its bf16 GEMM kernel by the number of rows
(AVX-512 for a few, AMX tiles above, another path for the rows of the M tail), so the same row
gets other bits alone than inside a batch: measured on a Xeon with AMX, a packed 2048 x 512
linear gives the last row of a 300-row call other bits than that row alone, a 4096 x 14336 one
changes row 0 from 33 rows up, and plain `F.linear` (the tied lm_head) too. On a CPU without
AMX (AVX512-BF16 only) oneDNN's packed bf16 linear is invariant as measured
(tests/unit/test_batch_invariant_ops.py), and this kernel is not used.

The kernel runs every row through the same AMX tile instructions, K-tile by K-tile in order,
so a row's bits do not depend on the row count, its position or the thread count (threads
split the output columns). `AmxLinear` holds the weight in the kernel's tile layout (packed
once at load; the plain weight is dropped).

Build: `pdserve.model.cpp_ext.CppKernel` (`KERNEL`), by `pdserve kernels build`. `load()` returns
None (and `KERNEL.why_unavailable()` says why) when the CPU has no AMX, it is not built (no
compiler), or the OS refuses the AMX tile state; `PDSERVE_AMX_LINEAR=0` keeps
`pdserve.model.kernels.select_kernels` from choosing it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from pdserve.model.cpp_ext import CppKernel

_CSRC = Path(__file__).parent / "csrc"
_FLAGS = [
    "-O3",
    "-mamx-tile",
    "-mamx-bf16",
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512bf16",
]


def cpu_has_amx() -> bool:
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def _init(ext: Any) -> str | None:
    """Ask the OS for the AMX tile state (Linux >= 5.16), once per process."""
    return None if ext.init() else "the OS refused the AMX tile state"


KERNEL = CppKernel(
    "amx_linear",
    _CSRC / "amx_linear.cpp",
    {"amx": _FLAGS},
    cpu_lacks=lambda variant: None if cpu_has_amx() else "no AMX on this CPU",
    init=_init,
)


def load() -> Any | None:
    """The prebuilt module with AMX granted to this process, or None (never compiles)."""
    return KERNEL.load()


def available() -> bool:
    return load() is not None


def _loaded() -> Any:
    ext = load()
    if ext is None:
        raise RuntimeError(f"the AMX linear kernel is not available: {KERNEL.why_unavailable()}")
    return ext


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> the kernel's tile layout [ceil(N/16), ceil(K/32), 16, 32] bf16."""
    return _loaded().pack(weight.detach().contiguous())


def linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x [..., K] bf16 @ W.T (+ bias) -> [..., n] bf16, W packed by `pack`."""
    lead = x.shape[:-1]
    y = _loaded().linear(x.reshape(-1, x.shape[-1]), packed, bias, n)
    return y.view(*lead, n)


class AmxLinear(nn.Module):
    """y = x @ W.T + b with W in the AMX kernel's tile layout. bf16, inference only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed = pack(weight)
        self.bias = None if bias is None else bias.detach().contiguous()

    @classmethod
    def from_linear(cls, lin: nn.Linear) -> AmxLinear:
        return cls(lin.weight, lin.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.packed, self.bias, self.out_features)

    def kernel_entry(self) -> tuple[Any, torch.Tensor, torch.Tensor | None, int]:
        """(fn, packed, bias, n): `fn(x [M, K], packed, bias, n)` is forward of a 2-d x
        (pdserve.model.direct_loop)."""
        return _loaded().linear, self.packed, self.bias, self.out_features

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"
