"""The llama layer loop with its kernels called directly: bf16 on a CPU where every op of a
layer has a compiled kernel (the AVX512-BF16 or AMX linears, the fused pointwise kernels and
the paged attention kernel).

The module loop (`llama.DecoderLayer`) reaches each kernel through an `nn.Module.__call__`, an
ops object and a backend method: ~20 Python frames per layer that cost ~1 ms of a bench50m
prefill step on one core (2 % of it; measured: docs/studies/cpu-kernels.md, "The direct layer
loop"). This loop resolves those frames once, when the runner has packed the
weights (`DirectLoop.build`), and then calls the kernel entries with the same arguments, in
the same order, on the same tensors: its bits equal the module loop's by construction, and
`tests/unit/test_direct_loop.py` checks them on mixed steps.

Invariants:
- it only runs a step whose attention plan is a `KernelPlan` (the batch-invariant kernel
  path); any other plan (SDPA, the torch fixed path) runs the module loop;
- a layer whose cache is not the 5-d paged bf16 cache (quantized KV) calls the backend, as
  the module loop does;
- it holds the packed weights the layers held when it was built: build it after
  `cpu_linear.pack_linears` (which never repacks a packed layer).

`pdserve.model.kernels.select_kernels` decides whether a model runs it (`loop="direct"`);
`PDSERVE_DIRECT_LOOP=0` keeps the module loop (the baseline of the benchmark).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from pdserve.model.attention import fixed_kernel

# A linear's kernel entry: (fn, packed weight, bias, out_features); fn(x [M, K], *rest) -> [M, N]
LinearEntry = tuple[Callable[..., torch.Tensor], torch.Tensor, torch.Tensor | None, int]


class _Layer(NamedTuple):
    """One decoder layer's kernel arguments."""

    norm1: torch.Tensor  # input_layernorm weight [hidden]
    eps1: float
    qkv: LinearEntry
    o: LinearEntry
    norm2: torch.Tensor  # post_attention_layernorm weight [hidden]
    eps2: float
    gate_up: LinearEntry  # its output is silu(gate) * up when fuses_silu_mul
    fuses_silu_mul: bool
    down: LinearEntry
    window: int  # 0: full attention


def linear_entry(module: nn.Module) -> LinearEntry | None:
    """The module's kernel entry, or None when it has none (a plain or oneDNN linear)."""
    entry = getattr(module, "kernel_entry", None)
    return entry() if entry is not None else None


class DirectLoop:
    """The decoder layers of a llama model, as direct kernel calls (see the module doc)."""

    def __init__(
        self,
        layers: list[_Layer],
        ops: Any,  # the fused pointwise kernels (pointwise.FusedBf16Pointwise.kernels)
        attend: Callable[..., torch.Tensor],  # the attention kernel's attend_paged entry
        backend: Any,  # the model's attention backend (quantized-KV layers)
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        mlp_chunk_rows: int,
    ) -> None:
        self.layers = layers
        self._ops = ops
        self._attend = attend
        self._backend = backend
        self.h, self.hkv, self.d = num_heads, num_kv_heads, head_dim
        self.q_size = num_heads * head_dim
        self.v_start = (num_heads + num_kv_heads) * head_dim  # v's first column in qkv
        self.scale = backend.scale
        self.mlp_chunk_rows = mlp_chunk_rows

    @classmethod
    def build(cls, model: Any, mlp_chunk_rows: int) -> DirectLoop | None:
        """For a `llama.LlamaModel` whose ops all have kernel entries, else None."""
        ops, backend = model.pointwise, model.attn_backend
        if not (ops.fused and getattr(backend, "use_kernel", False)):
            return None  # torch pointwise ops (fp32, GPU) or not the attention kernel
        layers = []
        for layer in model.layers:
            if layer.q_norm is not None:  # qwen3's per-head norms: the module loop
                return None
            qkv, o, gate_up, down = (
                linear_entry(m)
                for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
            )
            if qkv is None or o is None or gate_up is None or down is None:
                return None
            n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
            fuses = bool(getattr(layer.gate_up_proj, "fuses_silu_mul", False))
            layers.append(
                _Layer(n1.weight, n1.eps, qkv, o, n2.weight, n2.eps, gate_up, fuses, down,
                       layer.window or 0)
            )  # fmt: skip
        first = model.layers[0]
        return cls(
            layers,
            ops.kernels,
            backend.kernel_module().attend_paged,
            model.attn_backend,
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
            mlp_chunk_rows,
        )

    @staticmethod
    def accepts(plan: Any) -> bool:
        return type(plan) is fixed_kernel.KernelPlan

    def __call__(
        self,
        x: torch.Tensor,  # [T, hidden] bf16, the embeddings (updated in place)
        cos: torch.Tensor,  # [T, 1, D] (llama.RotaryCache.lookup)
        sin: torch.Tensor,  # [T, 1, D] signed sin
        kv_caches: list[torch.Tensor],
        plan: fixed_kernel.KernelPlan,
        layer_callback: Callable[[int], None] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x, delta) after the last layer, as the module loop returns them."""
        t = x.shape[0]
        h, hkv, d, q_size, v_start = self.h, self.hkv, self.d, self.q_size, self.v_start
        cos, sin = cos.view(-1, d), sin.view(-1, d)  # [T, D], as rope_qk reads them
        ops, attend, scale = self._ops, self._attend, self.scale
        tables, seq, pos, ctx, k_rows = (
            plan.tables, plan.tok_seq, plan.tok_pos, plan.ctx_lens, plan.k_rows
        )  # fmt: skip
        delta: torch.Tensor | None = None
        for i, layer in enumerate(self.layers):
            if delta is None:
                hid = ops.rms_norm(x, layer.norm1, layer.eps1)
            else:
                hid = ops.add_rms_norm(x, delta, layer.norm1, layer.eps1)  # x += delta
            fn, w, b, n = layer.qkv
            qkv = fn(hid, w, b, n)  # [T, (H + 2 Hkv) D]
            q, k = ops.rope_qk(qkv, cos, sin, h, hkv, d)  # [T, H, D], [T, Hkv, D]
            v = qkv[:, v_start:].view(t, hkv, d)
            cache = kv_caches[i]
            if cache.dim() == 5:  # the paged bf16 cache: the kernel writes k / v and attends
                a = attend(q, cache, tables, seq, pos, ctx, layer.window, scale, 0, k, v, k_rows)
            else:  # quantized KV: the backend's path, as the module loop runs it
                a = self._backend.forward(plan, q, k, v, cache, layer.window or None)
            fn, w, b, n = layer.o
            hid = ops.add_rms_norm(x, fn(a.view(t, q_size), w, b, n), layer.norm2, layer.eps2)
            delta = self._mlp(layer, hid)
            if layer_callback is not None:
                layer_callback(i)  # layer i's K/V for this step are in kv_caches[i]
        assert delta is not None, "a model has at least one layer"
        return x, delta

    def _mlp(self, layer: _Layer, hid: torch.Tensor) -> torch.Tensor:
        """down(silu(gate) * up) of hid [T, hidden], in row chunks as DecoderLayer.mlp."""
        t, rows = hid.shape[0], self.mlp_chunk_rows
        if t <= rows:
            return self._mlp_rows(layer, hid)
        out = hid.new_empty(t, layer.down[3])
        for r in range(0, t, rows):
            out[r : r + rows] = self._mlp_rows(layer, hid[r : r + rows])
        return out

    def _mlp_rows(self, layer: _Layer, hid: torch.Tensor) -> torch.Tensor:
        fn, w, b, n = layer.gate_up
        act = fn(hid, w, b, n)
        if not layer.fuses_silu_mul:
            act = self._ops.silu_mul(act)
        fn, w, b, n = layer.down
        return fn(act, w, b, n)
