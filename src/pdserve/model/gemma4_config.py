"""Gemma 4 text fields of an HF `config.json` (`Gemma4ForCausalLM`, model_type gemma4_text).

Torch-free (the router imports ModelConfig). Every Gemma4TextConfig field that changes the
text forward is parsed here or refused with a ModelLoadError naming the field:
- layer_types (sliding_attention | full_attention), sliding_window;
- per-layer head dims and KV head counts: full-attention layers use `global_head_dim`
  (transformers' default 512) and, only when attention_k_eq_v is set, `num_global_key_value_heads`;
  a config saved by transformers >= 5 carries the same as `per_layer_config` overrides;
- rope_parameters per layer type (default | proportional with partial_rotary_factor, factor);
- attention_k_eq_v (full layers: V = v_norm(k_proj(x))), num_kv_shared_layers (the last layers
  read the KV of the last earlier layer of their type), use_double_wide_mlp (2x intermediate on
  KV-shared layers), hidden_size_per_layer_input / vocab_size_per_layer_input (per-layer input
  embeddings), final_logit_softcapping, attention_bias, hidden_activation.
Refused: enable_moe_block, use_bidirectional_attention, other activations or rope types.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.errors import ModelLoadError

SLIDING, FULL = "sliding_attention", "full_attention"
ACTIVATIONS = ("gelu_pytorch_tanh",)
ROPE_TYPES = ("default", "proportional")
DEFAULT_GLOBAL_HEAD_DIM = 512  # transformers' Gemma4TextConfig default
DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # default | proportional
    theta: float
    partial_rotary_factor: float = 1.0  # proportional: rotated fraction of head_dim
    factor: float = 1.0  # proportional: inv_freq divided by it


@dataclass(frozen=True)
class Gemma4Fields:
    layer_types: tuple[str, ...]
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    kv_source: tuple[int, ...]  # per layer: the layer whose KV it reads (itself unless shared)
    k_eq_v: tuple[bool, ...]  # per layer: V is the (v-normed) K projection
    intermediate: tuple[int, ...]  # per layer MLP width (double-wide on shared layers)
    rope_sliding: RopeSpec
    rope_full: RopeSpec
    ple_dim: int  # hidden_size_per_layer_input; 0 = no per-layer input embeddings
    ple_vocab: int
    final_logit_softcapping: float | None
    activation: str

    def is_shared(self, layer: int) -> bool:
        return self.kv_source[layer] != layer

    def rope(self, layer_type: str) -> RopeSpec:
        return self.rope_sliding if layer_type == SLIDING else self.rope_full


def parse(raw: dict[str, Any], num_layers: int, heads: int) -> tuple[Gemma4Fields, int | None]:
    """-> (fields, sliding_window or None when no layer slides)."""
    if raw.get("enable_moe_block"):
        raise ModelLoadError("config.json: enable_moe_block=true (Gemma 4 MoE) is not supported")
    if raw.get("use_bidirectional_attention") is not None:
        raise ModelLoadError(
            "config.json: use_bidirectional_attention="
            f"{raw['use_bidirectional_attention']!r} is not supported (causal text only)"
        )
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ACTIVATIONS:
        raise ModelLoadError(f"config.json: hidden_activation={act!r} unsupported; {ACTIVATIONS}")
    types = raw.get("layer_types")
    if types is None:  # transformers' default: 5 sliding then 1 full
        types = [SLIDING if (i + 1) % 6 else FULL for i in range(num_layers)]
    types = list(types)
    if len(types) != num_layers or any(t not in (SLIDING, FULL) for t in types):
        raise ModelLoadError("config.json: layer_types must list num_hidden_layers of "
                             f"{SLIDING!r} / {FULL!r}")  # fmt: skip
    types[-1] = FULL  # transformers forces the last layer to full attention
    k_eq_v_flag = bool(raw.get("attention_k_eq_v", False))
    head_dim = int(raw.get("head_dim") or raw["hidden_size"] // heads)
    kvh = int(raw.get("num_key_value_heads") or heads)
    head_dims, kv_heads = _per_layer_shapes(raw, types, head_dim, kvh, k_eq_v_flag)
    for i, h in enumerate(kv_heads):
        if heads % h:
            raise ModelLoadError(f"config.json: layer {i}: {heads} heads not a multiple of {h}")
    n_shared = int(raw.get("num_kv_shared_layers") or 0)
    source = _kv_sources(types, n_shared)
    inter = int(raw["intermediate_size"])
    wide = bool(raw.get("use_double_wide_mlp", False))
    ple_dim = int(raw.get("hidden_size_per_layer_input") or 0)
    cap = raw.get("final_logit_softcapping")
    rope = raw.get("rope_parameters") or DEFAULT_ROPE
    fields = Gemma4Fields(
        layer_types=tuple(types),
        head_dims=tuple(head_dims),
        kv_heads=tuple(kv_heads),
        kv_source=tuple(source),
        k_eq_v=tuple(k_eq_v_flag and t == FULL for t in types),
        intermediate=tuple(
            inter * (2 if wide and source[i] != i else 1) for i in range(num_layers)
        ),
        rope_sliding=_rope(rope, SLIDING),
        rope_full=_rope(rope, FULL),
        ple_dim=ple_dim,
        ple_vocab=int(raw.get("vocab_size_per_layer_input") or raw["vocab_size"]),
        final_logit_softcapping=None if cap is None else float(cap),
        activation=act,
    )
    window = raw.get("sliding_window")
    if SLIDING in types and not window:
        raise ModelLoadError("config.json: sliding_attention layers need a sliding_window")
    return fields, (int(window) if SLIDING in types else None)


def _per_layer_shapes(
    raw: dict[str, Any], types: list[str], head_dim: int, kvh: int, k_eq_v: bool
) -> tuple[list[int], list[int]]:
    dims, heads = [head_dim] * len(types), [kvh] * len(types)
    overrides = raw.get("per_layer_config")
    if overrides is None:  # the published form: global_head_dim / num_global_key_value_heads
        gdim = int(raw.get("global_head_dim") or DEFAULT_GLOBAL_HEAD_DIM)
        gkv = raw.get("num_global_key_value_heads") if k_eq_v else None
        overrides = {
            i: {"head_dim": gdim} | ({} if gkv is None else {"num_key_value_heads": int(gkv)})
            for i, t in enumerate(types)
            if t == FULL
        }
    for key, over in overrides.items():
        try:
            i = int(key)
        except ValueError as exc:  # per-type keys are not written by transformers for gemma4
            raise ModelLoadError(f"config.json: per_layer_config key {key!r} unsupported") from exc
        if not 0 <= i < len(types):
            raise ModelLoadError(f"config.json: per_layer_config layer {i} out of range")
        for name, value in over.items():
            if name == "head_dim":
                dims[i] = int(value)
            elif name == "num_key_value_heads":
                heads[i] = int(value)
            else:
                raise ModelLoadError(f"config.json: per_layer_config field {name!r} unsupported")
    return dims, heads


def _kv_sources(types: list[str], n_shared: int) -> list[int]:
    """Layer i >= L - n_shared reads the KV of the last layer below L - n_shared of its type."""
    n = len(types)
    if not 0 <= n_shared < n:
        raise ModelLoadError(f"config.json: num_kv_shared_layers={n_shared} must be in [0, {n})")
    first = n - n_shared
    out = list(range(n))
    for i in range(first, n):
        producers = [j for j in range(first) if types[j] == types[i]]
        if not producers:
            raise ModelLoadError(
                f"config.json: num_kv_shared_layers={n_shared}: no earlier {types[i]} layer "
                f"produces the KV that layer {i} shares"
            )
        out[i] = producers[-1]
    return out


def _rope(params: dict[str, Any], layer_type: str) -> RopeSpec:
    p = params.get(layer_type)
    if not isinstance(p, dict):
        raise ModelLoadError(f"config.json: rope_parameters[{layer_type!r}] missing")
    kind = p.get("rope_type", "default")
    if kind not in ROPE_TYPES:
        raise ModelLoadError(
            f"config.json: rope_parameters[{layer_type!r}].rope_type={kind!r} unsupported; "
            f"supported: {ROPE_TYPES}"
        )
    theta = float(p.get("rope_theta", 10_000.0))
    if kind == "default":
        return RopeSpec("default", theta)
    return RopeSpec(
        "proportional",
        theta,
        float(p.get("partial_rotary_factor", 1.0)),
        float(p.get("factor", 1.0)),
    )
