"""One model file for the llama family: Llama, Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm),
Mistral (sliding window). GQA/MQA through the attention backend.

The batch is flattened: `input_ids[T]` holds the new tokens of every sequence in the step
(prefill chunks and decode tokens mixed, no padding); `positions[T]` their absolute positions;
the attention backend maps tokens to sequences through `AttentionMetadata`.

Differences from the HF module layout (the loader maps names): q/k/v are one fused
`qkv_proj` ([ (H + 2*Hkv) * D, hidden ]) and gate/up one `gate_up_proj` ([2 * I, hidden]),
which halves the matmul launches per layer. Parameters are created on the meta device and
materialised by `pdserve.model.loader` (load_state_dict(assign=True)).

The runner hands the model its `KernelSelection` (`use_kernels`, after packing the weights):
the pointwise ops, the attention kernel and, when every op has a compiled kernel, the layer
loop of `pdserve.model.direct_loop` (the same kernel calls without the module frames, the same
bits). Until then the model runs torch pointwise ops and the module loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pdserve.model import kernels, pointwise
from pdserve.model.attention import AttentionBackend, AttentionMetadata, select_backend
from pdserve.model.config import ModelConfig
from pdserve.model.cpu_linear import linear_rows
from pdserve.model.direct_loop import DirectLoop
from pdserve.model.pointwise import TorchPointwise, rms_norm_torch, rope_torch


class RMSNorm(nn.Module):
    """HF numerics: normalise in float32, cast back, then scale by the weight (the layers call
    it through `pointwise`, which may fuse it with the residual add)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_torch(x, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """[D/2] float32 inverse frequencies, with llama3 / linear scaling applied."""
    d = config.head_dim
    inv = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    sc = config.rope_scaling
    if sc is None:
        return inv
    factor = float(sc["factor"])
    if sc["rope_type"] == "linear":
        return inv / factor
    # llama3: long wavelengths divided by factor, short ones kept, smooth blend in between
    low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
    old_len = float(sc["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryCache:
    """cos / signed-sin tables [max_pos, D] in the HF rotate_half convention.

    HF: x * cos + cat(-x2, x1) * sin. We store sin_signed = cat(-sin_half, sin_half) and
    compute x * cos + roll(x, D/2) * sin_signed: the same products bit for bit (negation is
    exact), in fewer ops."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        t = torch.arange(config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(config))  # [P, D/2]
        self.cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(device=device, dtype=dtype)
        sin = freqs.sin()
        self.sin_signed = torch.cat([-sin, sin], -1).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos = self.cos.index_select(0, positions)[:, None, :]  # [T, 1, D]
        return cos, self.sin_signed.index_select(0, positions)[:, None, :]


apply_rope = rope_torch  # x [T, heads, D]; cos / sin_signed [T, 1, D]


MLP_CHUNK_ROWS = 512  # rows per MLP chunk on the fused path (DecoderLayer.mlp)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.window = c.layer_window(layer)
        self.q_size = c.num_heads * c.head_dim
        self.kv_size = c.num_kv_heads * c.head_dim
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, c.attention_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps) if c.qk_norm else None
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, c.o_proj_bias)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.gate_up_proj = nn.Linear(c.hidden_size, 2 * c.intermediate_size, c.mlp_bias)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, c.mlp_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden], the residual stream before the previous layer's delta
        delta: torch.Tensor | None,  # [T, hidden], the previous layer's MLP output (None: first)
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        backend: AttentionBackend,
        plan: object,
        ops: TorchPointwise,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (x, delta): the residual stream and this layer's MLP output, which the next norm
        adds (ops.add_norm: x + delta is rounded exactly as a separate add would round it)."""
        t = x.shape[0]
        x, h = ops.add_norm(x, delta, self.input_layernorm)
        qkv = self.qkv_proj(h)  # [T, (H + 2*Hkv) * D]
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:  # qwen3: per-head norms first
            q = self.q_norm(qkv[:, : self.q_size].view(t, self.num_heads, self.head_dim))
            k = self.k_norm(
                qkv[:, self.q_size : self.q_size + self.kv_size].view(t, -1, self.head_dim)
            )
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        else:  # one RoPE over q and k together
            q, k = ops.rope_qk(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        o = backend.forward(plan, q, k, v, kv_cache, self.window)  # [T, H, D]
        x, h = ops.add_norm(
            x, self.o_proj(o.reshape(t, self.q_size)), self.post_attention_layernorm
        )
        return x, self.mlp(h, ops)

    def mlp(self, h: torch.Tensor, ops: TorchPointwise) -> torch.Tensor:
        """down(silu(gate) * up) of h [T, hidden]. With the fused kernels, a long step runs in
        chunks of MLP_CHUNK_ROWS rows: [T, 2I] and [T, I] temporaries of a 4,096-token step
        (32 + 16 MiB in bench50m) fall out of the cache and are mmapped and page-faulted
        afresh at every call; chunks of rows stay in L2/L3 and in reused heap memory. Every op
        here is row by row, so chunking changes no bit."""
        t = h.shape[0]
        if not ops.fused or t <= MLP_CHUNK_ROWS:
            return self.down_proj(self.silu_gate_up(h, ops))
        out = h.new_empty(t, self.down_proj.out_features)
        for r in range(0, t, MLP_CHUNK_ROWS):
            rows = slice(r, r + MLP_CHUNK_ROWS)
            out[rows] = self.down_proj(self.silu_gate_up(h[rows], ops))
        return out

    def silu_gate_up(self, h: torch.Tensor, ops: TorchPointwise) -> torch.Tensor:
        """silu(gate) * up [T, I] of h: in the gate_up kernel's epilogue when it fuses it
        (cpu_linear.pack_linears; the same bits), else gate_up then silu_mul."""
        if getattr(self.gate_up_proj, "fuses_silu_mul", False):
            return self.gate_up_proj(h)
        return ops.silu_mul(self.gate_up_proj(h))


class LlamaModel(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        with torch.device("meta"):  # materialised by the loader
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
            self.lm_head = (
                None
                if config.tie_word_embeddings
                else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            )
        self.tied_head: nn.Module | None = None  # a packed copy of the tied head (cpu_linear)
        device = torch.device(device)
        self.rope = RotaryCache(config, device, dtype)
        self.pointwise: TorchPointwise = TorchPointwise()  # or the fused kernels: use_kernels
        self.attn_backend = backend or select_backend(
            device, config.num_heads, config.num_kv_heads, config.head_dim
        )
        self.direct_loop: DirectLoop | None = None  # use_kernels

    def use_kernels(self, selection: kernels.KernelSelection) -> kernels.KernelSelection:
        """Run what `selection` chose (ModelRunner, once the linears are packed): its
        pointwise ops, its attention and, for loop="direct", the layers as direct kernel
        calls (pdserve.model.direct_loop; the same bits as the module loop). Returns the
        selection as it runs."""
        self.pointwise = pointwise.ops(selection.pointwise)
        if hasattr(self.attn_backend, "use_kernels"):
            self.attn_backend.use_kernels(selection)
        direct = selection.loop == "direct"
        self.direct_loop = DirectLoop.build(self, MLP_CHUNK_ROWS) if direct else None
        return kernels.bound(selection, self.direct_loop is not None)

    def silu_mul_linears(self) -> list[nn.Module]:
        """The gate_up projections, whose output always goes through silu_mul (a packer may
        fuse it: cpu_linear.pack_linears)."""
        return [layer.gate_up_proj for layer in self.layers]

    def set_batch_invariant(self, flag: bool) -> None:
        """The engine's batch-invariance setting, for the attention this model runs."""
        if hasattr(self.attn_backend, "batch_invariant"):
            self.attn_backend.batch_invariant = flag

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        layer_callback: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        plan = self.attn_backend.prepare(meta)  # once per step, shared by all layers
        cos, sin = self.rope.lookup(positions)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        direct = self.direct_loop
        if direct is not None and direct.accepts(plan):
            x, delta = direct(x, cos, sin, kv_caches, plan, layer_callback)
        else:
            delta = None
            for i, layer in enumerate(self.layers):
                x, delta = layer(
                    x, delta, cos, sin, kv_caches[i], self.attn_backend, plan, self.pointwise
                )
                if layer_callback is not None:
                    layer_callback(i)  # layer i's K/V for this step are in kv_caches[i]
        return self.pointwise.add_norm(x, delta, self.norm)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] float32
        if self.tied_head is not None:
            return self.tied_head(hidden).float()
        if self.lm_head is None:  # tied to the embedding; >= 4 rows: batch-invariant in MKL
            return linear_rows(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()  # a module call: lm_head may be packed (cpu_linear)
