"""Gemma 4 text model (`Gemma4ForCausalLM`) over the paged attention backends.

Same interface as LlamaModel (flattened batch, `forward(input_ids, positions, kv_caches, meta,
layer_callback)`, `compute_logits`). Per layer (see gemma4_config for the fields):
  h = x + post_attn_norm(attn(input_norm(x)))
  h = h + post_ff_norm(mlp(pre_ff_norm(h)))
  h = h + post_ple_norm(ple_proj(gelu(ple_gate(h)) * ple_i))     (per-layer inputs, if any)
  x = h * layer_scalar
attention: q = rope(q_norm(q)), k = rope(k_norm(k)), v = v_norm(v) (RMS norm without scale),
scale 1.0; on K = V layers v = v_norm(k_proj(x)). Sliding and full layers have their own head
dims, KV head counts and RoPE tables; there is one attention backend per (KV heads, head dim).

KV caches: one tensor per layer that stores KV (ModelConfig.kv_layers()): [blocks, 2, bs, Hkv, D],
or [blocks, 1, bs, Hkv, D] holding V only on K = V layers (gemma4_keqv); a KV-shared layer
attends over its source layer's cache with the K/V its source computed in this very step (the
backend rewrites the same rows, a no-op, then attends), so it stores and moves nothing.
`layer_callback(c)` fires once per stored cache c, after its layer ran.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import AttentionBackend, AttentionMetadata, select_backend
from pdserve.model.config import ModelConfig
from pdserve.model.gemma4_config import RopeSpec
from pdserve.model.gemma4_keqv import keqv_attention, plan_keqv
from pdserve.model.llama import apply_rope


class Gemma4RMSNorm(nn.Module):
    """transformers' numerics: x * (mean(x^2) + eps)^-0.5 in float32, times the weight."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            y = y * self.weight.float()
        return y.type_as(x)


def rope_tables(
    spec: RopeSpec, head_dim: int, max_pos: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos / signed-sin [max_pos, head_dim] (see llama.RotaryCache). proportional: the first
    partial_rotary_factor of the frequencies rotate, the rest are 0 (cos 1, sin 0)."""
    exps = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    if spec.rope_type == "default":
        inv = 1.0 / (spec.theta**exps)
    else:
        n_rot = int(spec.partial_rotary_factor * head_dim // 2)
        inv = torch.zeros(head_dim // 2)
        inv[:n_rot] = 1.0 / (spec.theta ** exps[:n_rot])
        inv = inv / spec.factor
    freqs = torch.outer(torch.arange(max_pos, dtype=torch.float32), inv)
    cos = torch.cat([freqs.cos(), freqs.cos()], -1).to(device=device, dtype=dtype)
    sin = freqs.sin()
    return cos, torch.cat([-sin, sin], -1).to(device=device, dtype=dtype)


class Gemma4Layer(nn.Module):
    def __init__(self, c: ModelConfig, layer: int) -> None:
        super().__init__()
        g = c.gemma4
        assert g is not None
        kv = c.layer_kv(layer)
        self.layer_type = g.layer_types[layer]
        self.shared = kv.source != layer
        self.k_eq_v = kv.k_eq_v
        self.window = kv.window
        self.heads, self.kv_heads, self.head_dim = c.num_heads, kv.num_kv_heads, kv.head_dim
        self.q_size, self.kv_size = c.num_heads * kv.head_dim, kv.num_kv_heads * kv.head_dim
        n_kv = 0 if self.shared else (1 if self.k_eq_v else 2)  # K and V projections present
        h, eps, bias = c.hidden_size, c.rms_norm_eps, c.attention_bias
        self.input_layernorm = Gemma4RMSNorm(h, eps)
        self.qkv_proj = nn.Linear(h, self.q_size + n_kv * self.kv_size, bias)
        self.q_norm = Gemma4RMSNorm(kv.head_dim, eps)
        self.k_norm = None if self.shared else Gemma4RMSNorm(kv.head_dim, eps)
        self.v_norm = None if self.shared else Gemma4RMSNorm(kv.head_dim, eps, with_scale=False)
        self.o_proj = nn.Linear(self.q_size, h, bias)
        self.post_attention_layernorm = Gemma4RMSNorm(h, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        inter = g.intermediate[layer]
        self.gate_up_proj = nn.Linear(h, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, h, bias=False)
        self.post_feedforward_layernorm = Gemma4RMSNorm(h, eps)
        self.ple = g.ple_dim > 0
        if self.ple:
            self.per_layer_input_gate = nn.Linear(h, g.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(g.ple_dim, h, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(h, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def qkv(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """q [T, H, D] (normed, rotated); k, v [T, Hkv, D] (None on a KV-shared layer)."""
        t = x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))
        q = apply_rope(self.q_norm(qkv[:, : self.q_size].view(t, self.heads, -1)), cos, sin)
        if self.shared:
            return q, None, None
        assert self.k_norm is not None and self.v_norm is not None
        kp = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, self.kv_heads, -1)
        vp = kp if self.k_eq_v else qkv[:, self.q_size + self.kv_size :].view(t, self.kv_heads, -1)
        return q, apply_rope(self.k_norm(kp), cos, sin), self.v_norm(vp)

    def finish(self, x: torch.Tensor, o: torch.Tensor, ple: torch.Tensor | None) -> torch.Tensor:
        """Everything after attention: o [T, H, D] -> the layer's output [T, hidden]."""
        x = x + self.post_attention_layernorm(self.o_proj(o.reshape(x.shape[0], self.q_size)))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(x)).chunk(2, dim=-1)
        x = x + self.post_feedforward_layernorm(
            self.down_proj(F.gelu(gate, approximate="tanh") * up)
        )
        if self.ple:
            assert ple is not None
            y = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * ple
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(y))
        return x * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: AttentionBackend | None = None,
    ) -> None:
        super().__init__()
        g = config.gemma4
        if g is None:
            raise ValueError("Gemma4Model needs a Gemma 4 config")
        self.config, self.g = config, g
        h, n = config.hidden_size, config.num_layers
        with torch.device("meta"):  # materialised by the loader
            self.embed_tokens = nn.Embedding(config.vocab_size, h)
            self.layers = nn.ModuleList(Gemma4Layer(config, i) for i in range(n))
            self.norm = Gemma4RMSNorm(h, config.rms_norm_eps)
            self.lm_head = (
                None if config.tie_word_embeddings else nn.Linear(h, config.vocab_size, False)
            )
            self.tied_head: nn.Module | None = None  # a packed copy of the tied head (cpu_linear)
            if g.ple_dim:
                self.embed_tokens_per_layer = nn.Embedding(g.ple_vocab, n * g.ple_dim)
                self.per_layer_model_projection = nn.Linear(h, n * g.ple_dim, bias=False)
                self.per_layer_projection_norm = Gemma4RMSNorm(g.ple_dim, config.rms_norm_eps)
        device = torch.device(device)
        # transformers keeps the scales as float32 tensors cast to the weight dtype
        self.embed_scale = torch.tensor(h**0.5).to(dtype).item()
        self.ple_scale = torch.tensor(g.ple_dim**0.5).to(dtype).item() if g.ple_dim else 1.0
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.backends: dict[tuple[int, int], AttentionBackend] = {}
        self.batch_invariant = True  # set_batch_invariant: every backend and the K = V layers
        # layers whose KV source is a K = V layer attend over its one-tensor cache
        self.keqv = [config.layer_kv(i).k_eq_v for i in range(n)]
        for i, layer in enumerate(self.layers):
            key = (layer.kv_heads, layer.head_dim)
            if key not in self.backends and not self.keqv[i]:
                given = backend is not None and (backend.num_kv_heads, backend.head_dim) == key
                be = backend if given else select_backend(device, config.num_heads, *key)
                assert be is not None
                be.scale = 1.0  # Gemma 4: q and k are RMS-normed, no 1/sqrt(d)
                self.backends[key] = be
            if layer.layer_type not in self.rope:  # [max_pos, D] tables per layer type
                spec = g.rope(layer.layer_type)
                mp = config.max_position_embeddings
                self.rope[layer.layer_type] = rope_tables(spec, layer.head_dim, mp, device, dtype)
        self.cache_index = [config.kv_cache_index(i) for i in range(n)]
        # layer i attends over a sliding layer's cache (the window group's pool, if any)
        stored = config.kv_layers()
        self.sliding_cache = [stored[c].window is not None for c in self.cache_index]

    def set_batch_invariant(self, flag: bool) -> None:
        """The engine's batch-invariance setting, for every attention this model runs."""
        self.batch_invariant = flag
        for be in self.backends.values():
            if hasattr(be, "batch_invariant"):
                be.batch_invariant = flag

    def use_kernels(self, selection: Any) -> Any:
        """The attention of the engine's `KernelSelection` (pdserve.model.kernels), for every
        backend; its layers have their own ops and loop. Returns the selection."""
        for be in self.backends.values():
            if hasattr(be, "use_kernels"):
                be.use_kernels(selection)
        return selection

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # per stored layer [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        layer_callback: Callable[[int], None] | None = None,
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        # sliding layers read their own pool through meta.window when the engine keeps one
        # (pdserve.kv.window_group); one plan per (backend, table group) actually used
        plans: dict[tuple[tuple[int, int], bool], Any] = {}
        keqv_plan = plan_keqv(meta) if any(self.keqv) else None
        rope = {
            t: (cos.index_select(0, positions)[:, None], sin.index_select(0, positions)[:, None])
            for t, (cos, sin) in self.rope.items()
        }
        x = self.embed_tokens(input_ids) * self.embed_scale
        ple = self._per_layer_inputs(input_ids, x)  # [T, L, P] or None
        step_kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # source layer -> k, v
        for i, layer in enumerate(self.layers):
            cos, sin = rope[layer.layer_type]
            q, k, v = layer.qkv(x, cos, sin)
            src = self.config.layer_kv(i).source if layer.shared else i
            if k is None or v is None:
                k, v = step_kv[src]
            elif self.g.kv_source.count(i) > 1:  # some later layer reads this KV
                step_kv[i] = (k, v)
            cache = kv_caches[self.cache_index[i]]
            if self.keqv[i]:  # V-only cache; K = rope(k_norm.weight * V) rebuilt on read
                assert keqv_plan is not None
                w = self.layers[src].k_norm.weight
                cos_t, sin_t = self.rope[layer.layer_type]
                o = keqv_attention(
                    keqv_plan, q, k, v, cache, w, cos_t, sin_t, not layer.shared,
                    invariant=self.batch_invariant,
                )  # fmt: skip
            else:
                key = (layer.kv_heads, layer.head_dim)
                sliding = meta.window is not None and self.sliding_cache[i]
                plan = plans.get((key, sliding))
                if plan is None:
                    m = meta.window if sliding and meta.window is not None else meta
                    plan = plans[(key, sliding)] = self.backends[key].prepare(m)
                o = self.backends[key].forward(plan, q, k, v, cache, layer.window)
            x = layer.finish(x, o, None if ple is None else ple[:, i])
            if layer_callback is not None and not layer.shared:
                layer_callback(self.cache_index[i])
        return self.norm(x)

    def _per_layer_inputs(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        p = self.g.ple_dim
        if not p:
            return None
        t, n = ids.shape[0], self.config.num_layers
        tok = (self.embed_tokens_per_layer(ids) * self.ple_scale).view(t, n, p)
        proj = self.per_layer_model_projection(x) * self.config.hidden_size**-0.5
        proj = self.per_layer_projection_norm(proj.view(t, n, p))
        return (proj + tok) * 2.0**-0.5

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [N, hidden] -> [N, vocab] float32; soft-capped in the model dtype, as
        # transformers does
        if self.tied_head is not None:
            logits = self.tied_head(hidden)
        elif self.lm_head is None:
            logits = F.linear(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        cap = self.g.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
