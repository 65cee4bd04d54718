"""This machine's limits and the engine's achieved fraction of them.

Two limits bound a CPU (or GPU) LLM engine:
- memory read bandwidth: a decode step reads every weight once plus the KV of every context;
- GEMM peak in the serving dtype: prefill is matrix-matrix work.

`measure_limits(dtype, threads)` measures both here, in the same process and thread count as
the engine (best of `repeats`; on a shared machine the best run is the least disturbed):
- bandwidth: the fastest of a few streaming reductions (fp32 sum, int16 and int32 max) over a
  buffer several times the last-level cache, in bytes read per second;
- GEMM peak: the fastest of `F.linear` and the oneDNN-prepacked linear the engine uses
  (`pdserve.model.cpu_linear`) over a few compute-bound shapes, in FLOP/s (2 per multiply-add).

`decode_step_bytes` / `prefill_flops` count what a step must move / compute for a model shape,
and `achieved_fraction` divides the engine's measured rates by the limits:
decode fraction = decode weight+KV bytes per second / bandwidth, prefill fraction = prefill
FLOP/s / GEMM peak. Used by `pdserve bench engine --limits` and by `pdserve profile`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.dtypes import torch_dtype
from pdserve.kv.footprint import kv_bytes_per_token, layers_of
from pdserve.model.config import ModelConfig

BANDWIDTH_BYTES = 256 << 20  # >= 4x the L3 of common server CPUs (32-64 MiB per CCD/socket)
GEMM_SHAPES = ((1024, 1024, 2048), (512, 2048, 2048))  # (M, K, N), weights stay in cache


def _dtype(dtype: str | torch.dtype) -> torch.dtype:
    return torch_dtype(dtype) if isinstance(dtype, str) else dtype


def _itemsize(dtype: str | torch.dtype) -> int:
    return torch.empty((), dtype=_dtype(dtype)).element_size()


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[int]:
    """Run with `threads` intra-op threads (None = leave as is); restores the old count."""
    old = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(old)


def best_time(fn: Callable[[], Any], repeats: int, clock: Callable[[], float]) -> float:
    """Least seconds of `repeats` calls of fn (after one warm-up call)."""
    fn()
    best = float("inf")
    for _ in range(max(1, repeats)):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return max(best, 1e-9)


def measure_bandwidth(
    nbytes: int = BANDWIDTH_BYTES, repeats: int = 5, clock: Callable[[], float] = time.perf_counter
) -> dict[str, float]:
    """Read bandwidth in bytes/s of each streaming kernel; "best" is their maximum."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    kernels: dict[str, Callable[[], Any]] = {
        "sum_f32": buf.sum,
        "max_i32": buf.view(torch.int32).max,
        "max_i16": buf.view(torch.int16).max,
    }
    out = {k: nbytes / best_time(fn, repeats, clock) for k, fn in kernels.items()}
    out["best"] = max(out.values())
    return out


def measure_gemm_peak(
    dtype: str | torch.dtype,
    repeats: int = 3,
    shapes: Sequence[tuple[int, int, int]] = GEMM_SHAPES,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, float]:
    """GEMM FLOP/s in `dtype` per kernel and shape; "best" is the maximum."""
    from pdserve.model import amx_linear, avx512_bf16_linear
    from pdserve.model.cpu_linear import PackedLinear, packing_supported

    dt = _dtype(dtype)
    out: dict[str, float] = {}
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for m, k, n in shapes:
            x = torch.randn(m, k, generator=g).to(dt)
            lin = torch.nn.Linear(k, n, bias=False, dtype=dt)
            flops = 2.0 * m * k * n
            out[f"linear_{m}x{k}x{n}"] = flops / best_time(
                lambda x=x, w=lin.weight: F.linear(x, w), repeats, clock
            )
            if packing_supported(dt):
                packed = PackedLinear(lin)
                out[f"packed_{m}x{k}x{n}"] = flops / best_time(
                    lambda x=x, p=packed: p(x), repeats, clock
                )
            if dt == torch.bfloat16 and amx_linear.available():  # the invariant kernel (AMX)
                amx = amx_linear.AmxLinear(lin.weight)
                out[f"amx_{m}x{k}x{n}"] = flops / best_time(lambda x=x, a=amx: a(x), repeats, clock)
            elif dt == torch.bfloat16 and avx512_bf16_linear.available():  # (AVX512-BF16)
                avx = avx512_bf16_linear.Avx512Bf16Linear(lin.weight)
                out[f"avx512bf16_{m}x{k}x{n}"] = flops / best_time(
                    lambda x=x, a=avx: a(x), repeats, clock
                )
    out["best"] = max(out.values())
    return out


def measure_limits(
    dtype: str | torch.dtype = "float32",
    threads: int | None = None,
    repeats: int = 5,
    bandwidth_bytes: int = BANDWIDTH_BYTES,
    clock: Callable[[], float] = time.perf_counter,
    gemm_shapes: Sequence[tuple[int, int, int]] = GEMM_SHAPES,
) -> dict[str, Any]:
    """{"dtype", "threads", "bandwidth_bytes_s", "gemm_flops_s", "detail": {...}} measured
    with `threads` torch threads (None = the current setting). `clock`: time.process_time is
    steadier on a shared machine with one thread (time off the CPU is not counted)."""
    with torch_threads(threads) as n:
        bw = measure_bandwidth(bandwidth_bytes, repeats, clock)
        gemm = measure_gemm_peak(dtype, max(2, repeats // 2 + 1), gemm_shapes, clock)
    return {
        "dtype": str(_dtype(dtype)).removeprefix("torch."),
        "threads": n,
        "bandwidth_bytes_s": bw["best"],
        "gemm_flops_s": gemm["best"],
        "detail": {"bandwidth": bw, "gemm": gemm},
    }


# ---- what the model has to move / compute -------------------------------------------------


@dataclass(frozen=True)
class ModelCost:
    """Per-model counts in a dtype (llama family, fused or not: the same parameters)."""

    layer_params: int  # linear weights + biases of all decoder layers
    lm_head_params: int  # vocab * hidden (tied or not: the logits GEMM reads it)
    norm_params: int
    kv_bytes_per_token: int  # all layers, K and V
    itemsize: int
    num_layers: int
    num_heads: int
    head_dim: int

    @classmethod
    def of(cls, c: ModelConfig, dtype: str | torch.dtype) -> ModelCost:
        h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
        q, kv = c.num_heads * d, c.num_kv_heads * d
        per_layer = h * (q + 2 * kv) + q * h + 3 * h * i
        per_layer += (q + 2 * kv) * c.attention_bias + h * c.o_proj_bias + (2 * i + h) * c.mlp_bias
        norms = c.num_layers * (2 * h + 2 * d * c.qk_norm) + h
        size = _itemsize(dtype)
        return cls(
            layer_params=per_layer * c.num_layers,
            lm_head_params=c.vocab_size * h,
            norm_params=norms,
            kv_bytes_per_token=2 * c.num_layers * kv * size
            if c.gemma4 is None
            else round(kv_bytes_per_token(layers_of(c), size, "one_pool")),
            itemsize=size,
            num_layers=c.num_layers,
            num_heads=c.num_heads,
            head_dim=d,
        )

    @property
    def weight_bytes(self) -> int:
        """Bytes a decode step reads once whatever the batch (embedding rows not counted)."""
        return (self.layer_params + self.lm_head_params + self.norm_params) * self.itemsize


def decode_step_bytes(cost: ModelCost, context_lens: Sequence[int]) -> int:
    """Bytes one decode step of len(context_lens) sequences must read: every weight once plus
    each sequence's K and V for its whole context (new token included)."""
    return cost.weight_bytes + cost.kv_bytes_per_token * int(sum(context_lens))


def prefill_flops(
    cost: ModelCost,
    query_lens: Sequence[int],
    cached_lens: Sequence[int] | None = None,
    sampled: int | None = None,
) -> float:
    """FLOPs (2 per multiply-add) of a prefill step: the linears for every token, causal
    attention (QK^T and PV over each token's visible context), and the lm_head for `sampled`
    rows (default: one per sequence)."""
    cached_lens = cached_lens or [0] * len(query_lens)
    tokens = int(sum(query_lens))
    linear = 2.0 * cost.layer_params * tokens
    # token j of a chunk (0-based) after c cached tokens sees c + j + 1 keys
    visible = sum(q * c + q * (q + 1) / 2 for q, c in zip(query_lens, cached_lens, strict=True))
    attn = 4.0 * cost.num_layers * cost.num_heads * cost.head_dim * visible
    head = 2.0 * cost.lm_head_params * (len(query_lens) if sampled is None else sampled)
    return linear + attn + head


def decode_phase_bytes(cost: ModelCost, batch: int, prompt_len: int, steps: int) -> int:
    """Bytes read by `steps` decode steps of `batch` sequences that start with `prompt_len`
    tokens plus the first sampled one (step s appends the (prompt_len + 1 + s)-th token)."""
    return sum(decode_step_bytes(cost, [prompt_len + 1 + s] * batch) for s in range(max(0, steps)))


def decode_phase_flops(cost: ModelCost, batch: int, prompt_len: int, steps: int) -> float:
    """FLOPs of the same decode steps as decode_phase_bytes: every linear and the lm_head once
    per sequence per step, plus attention over each context."""
    per_token = 2.0 * (cost.layer_params + cost.lm_head_params)
    attn_keys = sum(batch * (prompt_len + 1 + s) for s in range(max(0, steps)))
    return per_token * batch * max(0, steps) + (
        4.0 * cost.num_layers * cost.num_heads * cost.head_dim * attn_keys
    )


def achieved_fraction(
    limits: dict[str, Any],
    *,
    prefill_flops_s: float | None = None,
    decode_bytes_s: float | None = None,
    decode_flops_s: float | None = None,
) -> dict[str, float]:
    """For what is given: "prefill" = FLOP/s / GEMM peak; "decode" = weight+KV bytes/s /
    bandwidth; with decode_flops_s too, "decode_roofline" = the larger of the decode's
    bandwidth and compute fractions (at large batches decode on a CPU turns compute-bound, and
    the bandwidth fraction alone then understates how close it runs to the machine's limit)."""
    out: dict[str, float] = {}
    if prefill_flops_s is not None:
        out["prefill"] = prefill_flops_s / limits["gemm_flops_s"]
    if decode_bytes_s is not None:
        out["decode"] = decode_bytes_s / limits["bandwidth_bytes_s"]
        if decode_flops_s is not None:
            out["decode_roofline"] = max(out["decode"], decode_flops_s / limits["gemm_flops_s"])
    return out


def format_limits(limits: dict[str, Any]) -> str:
    return (
        f"limits ({limits['dtype']}, {limits['threads']} thread(s)): read bandwidth "
        f"{limits['bandwidth_bytes_s'] / 1e9:.1f} GB/s, GEMM peak "
        f"{limits['gemm_flops_s'] / 1e9:.0f} GFLOP/s"
    )
