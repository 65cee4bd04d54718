"""Linear layers with oneDNN-prepacked weights, for CPU serving.

`F.linear` on CPU hands a plain row-major weight to MKL (fp32) or oneDNN (bf16) on every call.
For the small row counts of decode that wastes most of the memory bandwidth: measured on this
repository's CI machine (one thread, 48 weights of 512x4096, more than the L3), a bf16
`F.linear` of one row streams its weight at ~8.5 GB/s and fp32 at ~10.5 GB/s, while a
weight reordered once into oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
the same call Inductor's CPU freezing pass makes) streams at ~15 GB/s; at 8-256 rows the packed
fp32 GEMM is ~2x `F.linear`. End-to-end figures: docs/studies/cpu-kernels.md "bf16 against fp32".

`pack_linears(model)` swaps every `nn.Linear` in a model for a `PackedLinear` in place (same
parameters, same dtype; the plain weight is dropped, so memory does not grow). The packed
weight is an opaque mkldnn tensor: packed modules are for inference only and do not appear in
`state_dict()`. Numerics: the same products, summed in oneDNN's order instead of MKL's; fp32
results differ from `F.linear` by float rounding only (~1e-6 relative).

Batch invariance (measured, `tests/unit/test_batch_invariant_ops.py`): a packed bf16 linear
gives a row the same bits for any row count, row position and thread count. In fp32, oneDNN
takes a matrix-vector kernel for ONE row when in_features >= ~2048, which sums in another
order; `pack_linears(batch_invariant=True)` sets `min_rows=FP32_MIN_ROWS` (4) for fp32, which
pads one to three rows to four so every row count runs the same kernel. Four, not two: every
count >= 2 gives a row the same bits, but oneDNN's fp32 kernel takes 19-27 % more time at two
rows than at four (CPU time, one thread, bench50m's shapes 512x2048 / 2048x512 / 512x16384,
weights out of cache: 422 / 409 / 3155 us vs 308 / 333 / 2566 us), and a batch-1 decode pads
its one row. Plain `F.linear` in fp32 (MKL) has three
row-count classes (1, 2-3, >= 4): `linear_rows` pads to MIN_MKL_ROWS for the tied lm_head.

On a CPU with AMX none of this holds in bf16: oneDNN picks its bf16 kernel by the row count
there (`pdserve.model.amx_linear`), so `pack_linears(batch_invariant=True)` puts every bf16
linear on the AMX kernel of that module instead (`kernel="amx"`, as `pdserve.model.kernels` selects
it), which is invariant by construction; `batch_invariant=False` keeps oneDNN. On a CPU with AVX512-BF16 and no AMX (AMD Zen 4),
oneDNN's bf16 linear is not reliably invariant either (measured on this repository's EPYC: a
2048-input packed linear gives row 0 other bits alone than among 2+ rows; the table above was
measured on an earlier EPYC), so an invariant engine serves bf16 on
`pdserve.model.avx512_bf16_linear` there: invariant by construction, its weights packed back
to back in model order, and faster for decode (it streams a one-row product's weights at
~2-2.5x oneDNN's GB/s; near parity from 128 rows; docs/studies/cpu-kernels.md "The linear
kernels"). `PDSERVE_AVX512_BF16_LINEAR=0` keeps oneDNN (the selection's
reason and a warning say bf16 is then not invariant).
A tied lm_head gets a packed copy of the embedding
(`model.tied_head`) when invariant: on a Xeon even fp32 MKL has more row classes than
`linear_rows` pads away (measured: 64 rows differ from 1-5).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import amx_linear, avx512_bf16_linear
from pdserve.model.cpu import BATCH_HINT, packing_supported
from pdserve.model.kernel_settings import KernelSettings
from pdserve.model.kernels import select_kernels

MIN_MKL_ROWS = 4  # MKL's fp32 GEMM: one kernel for >= 4 rows, others below
FP32_MIN_ROWS = 4  # packed fp32 linears: >= 2 rows for invariance, 4 for speed (module doc)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x [M, K] with zero rows appended up to `rows` (unchanged when M >= rows)."""
    m = x.shape[0]
    return x if m >= rows else torch.cat([x, x.new_zeros(rows - m, x.shape[1])])


def linear_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x [M, K], weight) computed with at least MIN_MKL_ROWS rows (batch-invariant)."""
    m = x.shape[0]
    return F.linear(pad_rows(x, MIN_MKL_ROWS), weight)[:m]


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX on this CPU (oneDNN otherwise emulates bf16, slower than fp32)."""
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(getattr(torch.cpu, name, lambda: False)() for name in checks)


class PackedLinear(nn.Module):
    """y = x @ W.T + b with W prepacked for oneDNN. x: [..., in_features] on CPU."""

    def __init__(self, linear: nn.Linear, batch_hint: int = BATCH_HINT, min_rows: int = 1) -> None:
        super().__init__()
        self.min_rows = min_rows  # run at least this many rows (FP32_MIN_ROWS: batch invariance)
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), batch_hint)
        self.bias = None if linear.bias is None else linear.bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if not x2.is_contiguous():
            x2 = x2.contiguous()
        m = x2.shape[0]
        if m < self.min_rows:
            x2 = pad_rows(x2, self.min_rows)
        y = torch.ops.mkldnn._linear_pointwise(x2, self.packed, self.bias, "none", [], "")
        return y[:m].view(*lead, self.out_features)

    def extra_repr(self) -> str:
        bias = self.bias is not None
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={bias}"


def pack_linears(
    model: nn.Module,
    batch_hint: int = BATCH_HINT,
    batch_invariant: bool = True,
    fuse_silu_mul: bool = True,
    kernel: str | None = None,
) -> int:
    """Replace every CPU `nn.Linear` of `model` (in a dtype oneDNN packs) by a packed layer, in
    place. Returns how many were packed; 0 when unsupported (the model is left as it was).
    kernel: what the bf16 layers run on, `KernelSelection.linear` ("amx", "avx512bf16" or
    "onednn"; other dtypes: oneDNN); None = what `pdserve.model.kernels.select_kernels` picks
    in this process (the `PDSERVE_*` switches).
    batch_invariant: fp32 layers run 1-3 rows padded to FP32_MIN_ROWS (see the module doc).
    fuse_silu_mul: on the AVX512-BF16 kernel, the layers the model lists in
    `silu_mul_linears()` (gate_up projections whose output always goes through silu_mul) get
    the silu_mul in their epilogue (Avx512Bf16SiluMulLinear: the same bits, one pass less).
    Idempotent."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and packing_supported(child.weight.dtype)
    ]

    def rows(dtype: torch.dtype) -> int:
        return FP32_MIN_ROWS if batch_invariant and dtype == torch.float32 else 1

    head = _unpacked_tied_head(model) if batch_invariant else None
    if head is not None and not packing_supported(head.dtype):
        head = None
    weights = [child.weight for _, _, child in targets] + ([head] if head is not None else [])
    bf16 = any(w.dtype == torch.bfloat16 for w in weights)
    if bf16 and kernel is None:
        settings = KernelSettings.from_env()
        kernel = select_kernels(settings, torch.bfloat16, "cpu", batch_invariant).linear
    amx = bf16 and kernel == "amx"
    avx = bf16 and kernel == "avx512bf16"

    # AVX512-BF16: the bf16 weights packed back to back in model order (one stream per step),
    # found again by their memory (the head's nn.Linear wraps the embedding in a new Parameter)
    def key(w: torch.Tensor) -> tuple[int, tuple[int, ...]]:
        return w.data_ptr(), tuple(w.shape)

    lists = avx and fuse_silu_mul and hasattr(model, "silu_mul_linears")
    silu_mul = model.silu_mul_linears() if lists else []
    fused = {key(lin.weight) for lin in silu_mul if type(lin) is nn.Linear}  # weights' keys
    avx_weights = [w for w in weights if w.dtype == torch.bfloat16] if avx else []
    order = avx512_bf16_linear.gate_up_order  # a fused layer's rows in its panel order
    avx_all = (
        avx512_bf16_linear.pack_all([order(w) if key(w) in fused else w for w in avx_weights])
        if avx_weights
        else []
    )
    avx_packed = dict(zip(map(key, avx_weights), avx_all, strict=True))

    def packed(lin: nn.Linear) -> nn.Module:
        if amx and lin.weight.dtype == torch.bfloat16:
            return amx_linear.AmxLinear.from_linear(lin)
        if avx and lin.weight.dtype == torch.bfloat16:
            cls = avx512_bf16_linear.Avx512Bf16Linear
            if key(lin.weight) in fused:
                cls = avx512_bf16_linear.Avx512Bf16SiluMulLinear
            return cls.from_linear(lin, avx_packed[key(lin.weight)])
        return PackedLinear(lin, batch_hint, rows(lin.weight.dtype))

    for module in model.modules():  # already packed (a model shared by engines): re-set
        if isinstance(module, PackedLinear):
            module.min_rows = rows(module.dtype)
    for parent, name, child in targets:
        setattr(parent, name, packed(child))
    if head is not None:  # the embedding stays for the lookup: a packed copy
        model.tied_head = packed(_linear_of(head))
    return len(targets)


def linear_kind(model: nn.Module) -> str:
    """What a model's linears run on, as `KernelSelection.linear` names it: "amx",
    "avx512bf16", "onednn" or "torch" (the kind of most of its linear layers)."""
    kinds = {
        amx_linear.AmxLinear: "amx",
        avx512_bf16_linear.Avx512Bf16Linear: "avx512bf16",
        avx512_bf16_linear.Avx512Bf16SiluMulLinear: "avx512bf16",
        PackedLinear: "onednn",
        nn.Linear: "torch",
    }
    found = [kinds[type(m)] for m in model.modules() if type(m) in kinds]
    return max(set(found), key=found.count) if found else "torch"


def _unpacked_tied_head(model: nn.Module) -> torch.Tensor | None:
    """The embedding a model computes its logits with (tied head) when it has no packed head
    yet (`model.tied_head`), on CPU; else None. Plain MKL/oneDNN GEMMs are not row-invariant
    for it on every CPU (fp32 on a Xeon: `linear_rows`' padding is not enough)."""
    if (
        getattr(model, "lm_head", False) is not None
        or getattr(model, "tied_head", False) is not None
    ):
        return None
    weight = model.embed_tokens.weight
    return weight if weight.device.type == "cpu" else None


def _linear_of(weight: torch.Tensor) -> nn.Linear:
    """An nn.Linear around an existing [N, K] weight (no copy)."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return lin
