"""Gemma 4 checkpoint tensors: HF names and shapes from the config, and the mapping onto
Gemma4Model (fused qkv_proj = [q; k; v] with k / v absent where the layer has none, fused
gate_up_proj = [gate; up])."""

from __future__ import annotations

import torch

from pdserve.model.config import ModelConfig

# KV tensors some checkpoints still carry for KV-shared layers (transformers ignores them)
SHARED_LAYER_EXTRAS = ("k_proj.weight", "v_proj.weight", "k_norm.weight", "v_norm.weight",
                       "k_proj.bias", "v_proj.bias")  # fmt: skip


def ignored(name: str, c: ModelConfig) -> bool:
    """True for a tensor that the forward does not use (shared layers' own K/V weights)."""
    g = c.gemma4
    assert g is not None
    parts = name.split(".")
    if len(parts) != 6 or parts[:2] != ["model", "layers"] or parts[3] != "self_attn":
        return False
    layer = int(parts[2]) if parts[2].isdigit() else -1
    return (
        0 <= layer < c.num_layers
        and g.is_shared(layer)
        and ".".join(parts[4:]) in (SHARED_LAYER_EXTRAS)
    )


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    g = c.gemma4
    assert g is not None
    h = c.hidden_size
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    if g.ple_dim:
        out |= {
            "model.embed_tokens_per_layer.weight": (g.ple_vocab, c.num_layers * g.ple_dim),
            "model.per_layer_model_projection.weight": (c.num_layers * g.ple_dim, h),
            "model.per_layer_projection_norm.weight": (g.ple_dim,),
        }
    for n in range(c.num_layers):
        p, a = f"model.layers.{n}.", f"model.layers.{n}.self_attn."
        d, i = g.head_dims[n], g.intermediate[n]
        q, kv = c.num_heads * d, g.kv_heads[n] * d
        out |= {
            p + "layer_scalar": (1,),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "pre_feedforward_layernorm.weight": (h,),
            p + "post_feedforward_layernorm.weight": (h,),
            a + "q_proj.weight": (q, h),
            a + "q_norm.weight": (d,),
            a + "o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        kv_names = [] if g.is_shared(n) else (["k"] if g.k_eq_v[n] else ["k", "v"])
        out |= {a + f"{x}_proj.weight": (kv, h) for x in kv_names}
        if kv_names:
            out[a + "k_norm.weight"] = (d,)
        if c.attention_bias:
            out |= {a + f"{x}_proj.bias": (q if x == "q" else kv,) for x in ["q", *kv_names]}
            out[a + "o_proj.bias"] = (h,)
        if g.ple_dim:
            out |= {
                p + "per_layer_input_gate.weight": (g.ple_dim, h),
                p + "per_layer_projection.weight": (h, g.ple_dim),
                p + "post_per_layer_input_norm.weight": (h,),
            }
    return out


def fuse(hf: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> Gemma4Model state dict."""
    g = c.gemma4
    assert g is not None
    sd = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = hf["lm_head.weight"]
    if g.ple_dim:
        for name in (
            "embed_tokens_per_layer",
            "per_layer_model_projection",
            "per_layer_projection_norm",
        ):
            sd[f"{name}.weight"] = hf[f"model.{name}.weight"]
    for n in range(c.num_layers):
        p, a, o = f"model.layers.{n}.", f"model.layers.{n}.self_attn.", f"layers.{n}."
        kv_names = [] if g.is_shared(n) else (["k"] if g.k_eq_v[n] else ["k", "v"])
        sd[o + "layer_scalar"] = hf[p + "layer_scalar"]
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            sd[o + f"{norm}.weight"] = hf[p + f"{norm}.weight"]
        sd[o + "qkv_proj.weight"] = torch.cat(
            [hf[a + f"{x}_proj.weight"] for x in ["q", *kv_names]]
        )
        if c.attention_bias:
            sd[o + "qkv_proj.bias"] = torch.cat(
                [hf[a + f"{x}_proj.bias"] for x in ["q", *kv_names]]
            )
            sd[o + "o_proj.bias"] = hf[a + "o_proj.bias"]
        sd[o + "q_norm.weight"] = hf[a + "q_norm.weight"]
        if kv_names:
            sd[o + "k_norm.weight"] = hf[a + "k_norm.weight"]
        sd[o + "o_proj.weight"] = hf[a + "o_proj.weight"]
        m = p + "mlp."
        sd[o + "gate_up_proj.weight"] = torch.cat(
            [hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]]
        )
        sd[o + "down_proj.weight"] = hf[m + "down_proj.weight"]
        if g.ple_dim:
            for name in (
                "per_layer_input_gate",
                "per_layer_projection",
                "post_per_layer_input_norm",
            ):
                sd[o + f"{name}.weight"] = hf[p + f"{name}.weight"]
    return sd
