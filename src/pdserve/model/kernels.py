"""The one place that chooses the forward pass's kernels, and says why.

`select_kernels(settings, dtype, device, batch_invariant, ...)` returns a frozen
`KernelSelection`: the layer loop, the attention path and its ISA build, the linear kernel and
the pointwise ops, each with the reason it was chosen. `ModelRunner` calls it once per engine
and hands the record to the model (`use_kernels`), which builds exactly that; the worker logs
it at start and registers its `summary()` (shown by `pdserve status`); `pdserve kernels`
prints it for this machine. docs/INTERNALS.md has the decision table.

Inputs: the switches (`KernelSettings`, `PDSERVE_*`), the dtype, the device, batch
invariance, the model (qwen3's per-head norms and Gemma 4 keep the module loop), the CPU
(`CpuFeatures`) and which prebuilt kernels load (`probe`; nothing is compiled here:
`pdserve kernels build` builds them). Tests pass `cpu` and `probe` to reach every branch.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from pdserve.model import amx_linear, avx512_bf16_linear, pointwise
from pdserve.model.attention import auto_backend_name, fixed_kernel
from pdserve.model.cpp_ext import BuildResult, CppKernel
from pdserve.model.cpu import CpuFeatures, packing_supported
from pdserve.model.kernel_settings import KernelSettings

# every C++ kernel of the package, with what runs when it is not there
ALL: tuple[CppKernel, ...] = (
    fixed_kernel.KERNEL,
    amx_linear.KERNEL,
    avx512_bf16_linear.KERNEL,
    pointwise.KERNEL,
)
FALLBACK = {
    "fixed_attn": "the torch fixed attention",
    "amx_linear": "oneDNN (bf16 not batch-invariant on a CPU with AMX)",
    "avx512_bf16_linear": "oneDNN",
    "bf16_pointwise": "torch pointwise ops",
}
NOT_INVARIANT = "NOT batch-invariant"

# (kernel, variant) -> None when its prebuilt module loads, else why not
Probe = Callable[[CppKernel, str], str | None]


def _probe(kernel: CppKernel, variant: str) -> str | None:
    return kernel.why_unavailable(variant)


@dataclass(frozen=True)
class KernelSelection:
    """What one engine's forward pass runs, and why (`*_why`)."""

    loop: str  # direct | module
    loop_why: str
    attention: str  # kernel | fixed | sdpa | flashinfer
    attention_why: str
    isa: str  # the attention kernel's build: avx512bf16 | avx512 | scalar ("" off the kernel)
    isa_why: str
    linear: str  # amx | avx512bf16 | onednn | torch
    linear_why: str
    pointwise: str  # fused | torch
    pointwise_why: str
    warning: str = ""  # set when batch invariance was asked for and a choice breaks it

    def summary(self) -> str:
        """One short line: `loop=direct attn=kernel/avx512bf16 linear=amx pointwise=fused`."""
        attn = f"{self.attention}/{self.isa}" if self.isa else self.attention
        return f"loop={self.loop} attn={attn} linear={self.linear} pointwise={self.pointwise}"

    def reasons(self) -> dict[str, str]:
        return {k.removesuffix("_why"): v for k, v in asdict(self).items() if k.endswith("_why")}

    def table(self) -> str:
        """One line per choice and its reason (`pdserve kernels`)."""
        values = {"loop": self.loop, "attention": self.attention, "isa": self.isa or "-",
                  "linear": self.linear, "pointwise": self.pointwise}  # fmt: skip
        lines = [f"  {k:<10} {values[k]:<11} {why}" for k, why in self.reasons().items()]
        return "\n".join(lines + ([f"  warning: {self.warning}"] if self.warning else []))


def _dtype(dtype: torch.dtype | str) -> torch.dtype:
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def select_kernels(
    settings: KernelSettings,
    dtype: torch.dtype | str,
    device: torch.device | str,
    batch_invariant: bool,
    *,
    model: Any = None,  # a ModelConfig (family, qk_norm); None: a plain llama-style model
    kv_quantized: bool = False,
    cpu: CpuFeatures | None = None,
    probe: Probe = _probe,
) -> KernelSelection:
    """What an engine with these switches, dtype, device and invariance runs on this CPU (or
    `cpu`), given which prebuilt kernels load (`probe`). Pure apart from `probe`, which loads
    a kernel's module (never compiles). The table: docs/INTERNALS.md "Choosing the kernels"."""
    dtype, device = _dtype(dtype), torch.device(device)
    cpu = cpu or CpuFeatures.detect()
    family = getattr(model, "family", "llama")
    if device.type != "cpu":
        return _accelerator(device, batch_invariant)
    attention, attention_why, isa, isa_why = _attention(settings, batch_invariant, cpu, probe)
    if attention == "kernel" and kv_quantized:
        attention_why += "; quantized KV layers take the torch fixed path"
    linear, linear_why = _linear(settings, dtype, batch_invariant, cpu, probe)
    pw, pw_why = _pointwise(settings, dtype, family, cpu, probe)
    if not settings.direct_loop:
        loop, loop_why = "module", settings.switch("direct_loop")
    elif family == "gemma4" or getattr(model, "qk_norm", False):
        loop, loop_why = "module", f"{family}: its layers have no direct loop"
    else:
        lacking = [
            f"{name}={value}"
            for name, value, ok in (
                ("attention", attention, attention == "kernel"),
                ("linear", linear, linear in ("amx", "avx512bf16")),
                ("pointwise", pw, pw == "fused"),
            )
            if not ok
        ]
        loop, loop_why = (
            ("module", f"no kernel entry for {', '.join(lacking)}")
            if lacking
            else ("direct", "every op of a layer has a compiled kernel")
        )
    warning = linear_why if batch_invariant and NOT_INVARIANT in linear_why else ""
    return KernelSelection(
        loop, loop_why, attention, attention_why, isa, isa_why, linear, linear_why, pw, pw_why,
        warning,
    )  # fmt: skip


def _accelerator(device: torch.device, batch_invariant: bool) -> KernelSelection:
    name = auto_backend_name(device)
    if name == "flashinfer":
        attn, why = "flashinfer", f"{device.type}: flashinfer is installed"
    elif batch_invariant:
        attn, why = "fixed", f"{device.type}: the torch fixed attention (no flashinfer)"
    else:
        attn, why = "sdpa", f"{device.type}, batch-variant: torch SDPA (no flashinfer)"
    off = f"{device.type}: the C++ kernels are CPU-only"
    return KernelSelection("module", off, attn, why, "", off, "torch", off, "torch", off)


def attention_isa(setting: str, cpu: CpuFeatures) -> tuple[str, str]:
    """The attention kernel's build for an `attn_kernel` setting on `cpu`, and why."""
    if setting == "scalar":
        return "scalar", "PDSERVE_ATTN_KERNEL=scalar"
    if not cpu.avx512:
        return "scalar", "no AVX-512 on this CPU"
    if setting == "avx512":
        return "avx512", "PDSERVE_ATTN_KERNEL=avx512: fp32 math"
    if cpu.avx512_bf16:
        return "avx512bf16", "AVX512-BF16: bf16 dot products"
    return "avx512", "AVX-512 without BF16: fp32 math"


def _attention(
    s: KernelSettings, batch_invariant: bool, cpu: CpuFeatures, probe: Probe
) -> tuple[str, str, str, str]:
    if not batch_invariant:
        return "sdpa", "batch-variant (--no-batch-invariant): torch SDPA", "", "not the kernel"
    if s.attn_kernel == "off":
        return "fixed", s.switch("attn_kernel"), "", "not the kernel"
    isa, isa_why = attention_isa(s.attn_kernel, cpu)
    missing = probe(fixed_kernel.KERNEL, isa)
    if missing is not None:
        return "fixed", missing, "", "not the kernel"
    return "kernel", "batch-invariant: the fused C++ kernel", isa, isa_why


def _linear(
    s: KernelSettings, dtype: torch.dtype, batch_invariant: bool, cpu: CpuFeatures, probe: Probe
) -> tuple[str, str]:
    if not s.pack_weights:
        gap = f": plain torch linears are {NOT_INVARIANT}" if batch_invariant else ""
        return "torch", s.switch("pack_weights") + gap
    if not packing_supported(dtype):
        gap = f": plain torch linears are {NOT_INVARIANT}" if batch_invariant else ""
        return "torch", f"oneDNN cannot pack {dtype} here{gap}"
    if dtype != torch.bfloat16:
        rows = ", 1-3 rows padded to 4" if batch_invariant else ""
        return "onednn", f"{dtype}: oneDNN prepacked{rows}"
    if not batch_invariant:
        return "onednn", "batch-variant: oneDNN prepacked bf16"
    for on, field, kernel, variant, name in (
        (cpu.amx, "amx_linear", amx_linear.KERNEL, "amx", "AMX"),
        (cpu.avx512_bf16, "avx512_bf16_linear", avx512_bf16_linear.KERNEL, "avx512bf16",
         "AVX512-BF16 and no AMX"),
    ):  # fmt: skip
        if not on:
            continue
        gap = f"oneDNN's bf16 is {NOT_INVARIANT} on this CPU"
        if not getattr(s, field):
            return "onednn", f"{s.switch(field)}: {gap}"
        missing = probe(kernel, variant)
        if missing is not None:
            return "onednn", f"{missing}; {gap}"
        return variant, f"bf16, batch-invariant on a CPU with {name}"
    return "onednn", "bf16 without AMX or AVX512-BF16: oneDNN prepacked"


def _pointwise(
    s: KernelSettings, dtype: torch.dtype, family: str, cpu: CpuFeatures, probe: Probe
) -> tuple[str, str]:
    if dtype != torch.bfloat16:
        return "torch", f"{dtype}: torch ops (exact against transformers)"
    if family == "gemma4":
        return "torch", "gemma4: its own layer ops"
    if not s.bf16_pointwise:
        return "torch", s.switch("bf16_pointwise")
    if not cpu.avx512:
        return "torch", "no AVX-512 on this CPU"
    variant = "avx512bf16" if cpu.avx512_bf16 else "avx512"
    missing = probe(pointwise.KERNEL, variant)
    if missing is not None:
        return "torch", missing
    return "fused", f"bf16 on AVX-512 ({variant} build)"


def bound(selection: KernelSelection, direct_loop_bound: bool) -> KernelSelection:
    """The selection as it runs: a direct loop that could not bind runs the module loop."""
    if selection.loop == "direct" and not direct_loop_bound:
        return replace(selection, loop="module", loop_why="the direct loop could not bind")
    return selection


def linear_bound(selection: KernelSelection, actual: str) -> KernelSelection:
    """The selection as it runs when a model's linears are already another kind (packing is in
    place: a model shared by engines keeps what the first one packed)."""
    if actual == selection.linear:
        return selection
    why = f"packed before by another engine on this model (this one chose {selection.linear})"
    return replace(selection, linear=actual, linear_why=why)


def build_targets(
    settings: KernelSettings, all_variants: bool
) -> list[tuple[CppKernel, str | None]]:
    """(kernel, variant) pairs to build: the variants an engine here can serve (the attention
    kernel's as `settings` force it; not the AVX512-BF16 linear on a CPU with AMX), or with
    `all_variants` every variant this CPU runs (the tests also run the attention kernel's
    fp32-math build and the AVX512-BF16 linear); variant None: none is built."""
    cpu = CpuFeatures.detect()
    out: list[tuple[CppKernel, str | None]] = []
    for kernel in ALL:
        if all_variants:
            variants: list[str | None] = list(kernel.runnable_variants()) or [None]
        elif kernel is fixed_kernel.KERNEL:
            variants = [attention_isa(settings.attn_kernel, cpu)[0]]
        elif kernel.not_served() is not None:
            variants = [None]
        else:
            variants = [kernel.default_variant()]
        out += [(kernel, v) for v in variants]
    return out


def build_all(
    settings: KernelSettings,
    all_variants: bool = False,
    force: bool = False,
    on_done: Callable[[BuildResult], None] | None = None,
) -> list[BuildResult]:
    """Build `build_targets` (in parallel, one compiler per core; `on_done` hears each result
    as it comes); never raises: a kernel that cannot build is a result that names why (its
    fallback then runs). Results in `build_targets` order."""
    targets = build_targets(settings, all_variants)

    def one(target: tuple[CppKernel, str | None]) -> BuildResult:
        kernel, variant = target
        if variant is None and kernel.default_variant() is not None:
            result = BuildResult(kernel.name, None, "unsupported", str(kernel.not_served()))
        else:
            result = kernel.build(variant, force=force)
        if on_done is not None:
            on_done(result)
        return result

    workers = max(1, min(len(targets), os.cpu_count() or 1))
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(one, targets))
