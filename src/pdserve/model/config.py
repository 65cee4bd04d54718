"""ModelConfig: the llama-family hyper-parameters parsed from an HF `config.json`.

Torch-free on purpose: the router imports it. Accepts both the classic HF keys
(`rope_theta`, `rope_scaling`) and the transformers>=5 `rope_parameters` dict.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.errors import ModelLoadError
from pdserve.model.gemma4_config import Gemma4Fields
from pdserve.model.gemma4_config import parse as parse_gemma4

# HF architecture name -> our family name
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma4ForCausalLM": "gemma4",
}
MODEL_TYPES = {v: k for k, v in ARCHITECTURES.items()}  # model_type -> architecture
MODEL_TYPES["gemma4_text"] = "Gemma4ForCausalLM"
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


@dataclass(frozen=True)
class LayerKVShape:
    source: int  # the layer whose KV this layer reads (itself unless shared)
    num_kv_heads: int
    head_dim: int
    window: int | None  # sliding window in tokens; None = full attention
    k_eq_v: bool = False  # V is the v-normed K projection (Gemma 4 full layers)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": "llama3"|"linear", ...}
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v (qwen2; llama's attention_bias also covers o_proj)
    qk_norm: bool  # qwen3: RMSNorm over head_dim on q and k, before RoPE
    sliding_window: int | None  # window in tokens (key allowed iff q_pos - k_pos < window)
    eos_token_ids: list[int]
    bos_token_id: int | None
    architecture: str  # HF name, e.g. "LlamaForCausalLM"
    torch_dtype: str  # dtype the checkpoint was saved in ("float32", "bfloat16", ...)
    o_proj_bias: bool = False  # llama attention_bias=True puts a bias on o_proj too
    mlp_bias: bool = False
    # per-layer: True where the sliding window applies (len == num_layers); None = all layers
    # use `sliding_window` when it is set
    sliding_layers: tuple[bool, ...] | None = None
    gemma4: Gemma4Fields | None = None  # Gemma 4 per-layer shapes, sharing, PLE, ... (else None)
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def family(self) -> str:
        return ARCHITECTURES[self.architecture]

    def layer_window(self, layer: int) -> int | None:
        """Sliding window of `layer` in tokens, or None for full attention."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    def layer_kv(self, layer: int) -> LayerKVShape:
        """What `layer` attends over: its KV source layer (itself unless it shares an earlier
        layer's KV), KV heads, head dim, window and whether K = V is one projection."""
        g = self.gemma4
        if g is None:
            return LayerKVShape(layer, self.num_kv_heads, self.head_dim, self.layer_window(layer))
        return LayerKVShape(
            g.kv_source[layer], g.kv_heads[layer], g.head_dims[layer],
            self.layer_window(layer), g.k_eq_v[layer],
        )  # fmt: skip

    def kv_layers(self) -> list[LayerKVShape]:
        """One entry per layer that stores KV (shared-KV layers store none), in layer order;
        the cache list of the engine has one tensor per entry."""
        return [s for i in range(self.num_layers) if (s := self.layer_kv(i)).source == i]

    def kv_cache_index(self, layer: int) -> int:
        """Index into the per-stored-layer cache list of the KV `layer` attends over."""
        src = self.layer_kv(layer).source
        return sum(1 for i in range(src) if self.layer_kv(i).source == i)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("extra")
        return d

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        model_dir = Path(model_dir)
        path = model_dir / "config.json"
        if not path.is_file():
            raise ModelLoadError(f"missing config.json in {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"unreadable config.json in {model_dir}: {exc}") from exc
        gen: dict[str, Any] = {}
        gen_path = model_dir / "generation_config.json"
        if gen_path.is_file():
            try:
                gen = json.loads(gen_path.read_text())
            except (OSError, ValueError) as exc:
                raise ModelLoadError(f"unreadable generation_config.json: {exc}") from exc
        return cls.from_dict(raw, generation_config=gen)

    @classmethod
    def from_dict(
        cls, raw: dict[str, Any], generation_config: dict[str, Any] | None = None
    ) -> ModelConfig:
        arch = _architecture(raw)
        family = ARCHITECTURES[arch]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            num_layers = int(raw["num_hidden_layers"])
            vocab = int(raw["vocab_size"])
            inter = int(raw["intermediate_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"config.json: missing or bad field {exc}") from exc
        if family == "gemma4":
            return _gemma4(cls, raw, arch, generation_config or {})
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        if heads % kv_heads != 0:
            raise ModelLoadError(
                f"config.json: num_attention_heads={heads} not a multiple of "
                f"num_key_value_heads={kv_heads}"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"config.json: hidden_act={act!r} unsupported (only 'silu')")
        rope_theta, rope_scaling = _rope(raw)
        window, layers = _sliding(raw, family, num_layers)
        # qwen2: q/k/v always have a bias; mistral never; llama/qwen3 follow attention_bias
        attn_bias = {"qwen2": True, "mistral": False}.get(
            family, bool(raw.get("attention_bias", False))
        )
        return cls(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            qk_norm=family == "qwen3",
            sliding_window=window,
            eos_token_ids=_eos_ids(raw, generation_config or {}),
            bos_token_id=_int_or_none(raw.get("bos_token_id")),
            architecture=arch,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            o_proj_bias=attn_bias and family == "llama",
            mlp_bias=bool(raw.get("mlp_bias", False)),
            sliding_layers=layers,
            extra=raw,
        )


def _gemma4(
    cls: type[ModelConfig], raw: dict[str, Any], arch: str, gen: dict[str, Any]
) -> ModelConfig:
    try:
        heads = int(raw["num_attention_heads"])
        num_layers = int(raw["num_hidden_layers"])
        fields, window = parse_gemma4(raw, num_layers, heads)
        first = fields.layer_types.index("sliding_attention") if window else 0
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=fields.kv_heads[first],
            head_dim=fields.head_dims[first],
            max_position_embeddings=int(raw.get("max_position_embeddings", 131072)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=fields.rope_sliding.theta,
            rope_scaling=None,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            qk_norm=True,
            sliding_window=window,
            eos_token_ids=_eos_ids(raw, gen),
            bos_token_id=_int_or_none(raw.get("bos_token_id")),
            architecture=arch,
            torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
            o_proj_bias=bool(raw.get("attention_bias", False)),
            sliding_layers=tuple(t == "sliding_attention" for t in fields.layer_types),
            gemma4=fields,
            extra=raw,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"config.json: missing or bad field {exc}") from exc


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return a
    if not archs and raw.get("model_type") in MODEL_TYPES:
        return MODEL_TYPES[raw["model_type"]]
    found = archs or raw.get("model_type")
    raise ModelLoadError(f"unsupported architecture {found!r}; supported: {sorted(ARCHITECTURES)}")


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or params.get("rope_theta") or 10000.0)
    scaling = raw.get("rope_scaling") or (params if params else None)
    if not scaling:
        return theta, None
    scaling = dict(scaling)
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope_scaling type {rope_type!r} unsupported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return theta, None
    scaling["rope_type"] = rope_type
    scaling.pop("type", None)
    scaling.pop("rope_theta", None)
    need = {
        "llama3": (
            "factor",
            "low_freq_factor",
            "high_freq_factor",
            "original_max_position_embeddings",
        ),
        "linear": ("factor",),
    }[rope_type]
    for key in need:
        if key not in scaling:
            raise ModelLoadError(f"rope_scaling ({rope_type}) is missing {key!r}")
    return theta, scaling


def _sliding(
    raw: dict[str, Any], family: str, num_layers: int
) -> tuple[int | None, tuple[bool, ...] | None]:
    window = _int_or_none(raw.get("sliding_window"))
    if family == "llama" or window is None:
        return None, None
    layer_types = raw.get("layer_types")
    if family in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        return None, None
    if layer_types is not None:
        if len(layer_types) != num_layers:
            raise ModelLoadError("config.json: len(layer_types) != num_hidden_layers")
        layers = tuple(t == "sliding_attention" for t in layer_types)
        return (window, layers) if any(layers) else (None, None)
    if family in ("qwen2", "qwen3"):
        first = int(raw.get("max_window_layers", num_layers))
        layers = tuple(i >= first for i in range(num_layers))
        return (window, layers) if any(layers) else (None, None)
    return window, None  # mistral: every layer


def _eos_ids(raw: dict[str, Any], gen: dict[str, Any]) -> list[int]:
    ids: list[int] = []
    for src in (raw.get("eos_token_id"), gen.get("eos_token_id")):
        vals = src if isinstance(src, list) else [src]
        for v in vals:
            if v is not None and int(v) not in ids:
                ids.append(int(v))
    return ids


def _int_or_none(v: Any) -> int | None:
    return None if v is None else int(v)
