"""A model's shapes from its config.json alone (no weights): parameters, KV bytes per token,
the built-in configs of public models and the shipped ones in model_configs/."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.kv.footprint import KVLayer, kv_bytes_per_token, window_group_split

MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"


def layers_of_hf(raw: dict[str, Any]) -> list[KVLayer]:
    """Per model layer KV, from an HF config.json dict (any supported family)."""
    from pdserve.kv.footprint import layers_of
    from pdserve.model.config import ModelConfig

    return layers_of(ModelConfig.from_dict(raw))


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_matrices: int = 3  # 3: gated (gate, up, down: Llama, Qwen); 2: fc1, fc2 (OPT, GPT-2)
    # per model layer KV (kv.footprint) when layers differ (Gemma 4); None = uniform
    kv_layers: tuple[KVLayer, ...] | None = None
    kv_context: int = 4096  # context at which a layered model's bytes per token are taken

    @property
    def matmul_params(self) -> int:
        """Parameters touched by a token's matmuls (every layer + lm_head; not the embedding
        gather)."""
        h, a, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attn = h * a + 2 * h * kv + a * h + (a + 2 * kv if self.attention_bias else 0)
        mlp = self.mlp_matrices * h * self.intermediate_size
        return self.num_layers * (attn + mlp + 2 * h) + self.vocab_size * h + h

    @property
    def head_params(self) -> int:
        """The lm_head's parameters (run once per sampled sequence, not per token)."""
        return self.vocab_size * self.hidden_size

    @property
    def params(self) -> int:
        emb = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.matmul_params + emb

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Engine cache bytes per token (kv.footprint, stage "one_pool"): KV-shared layers
        hold none. Sliding layers are counted in full here; `window_group` gives their share,
        which the simulator puts in a window pool as the engine does."""
        if self.kv_layers is None:
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize
        return round(kv_bytes_per_token(self.kv_layers, itemsize, "one_pool", self.kv_context))

    def window_group(self, itemsize: int) -> tuple[int, int] | None:
        """(W, the sliding layers' bytes per token) when the engine keeps them in a window
        pool (kv.footprint.window_group_split), else None."""
        return None if self.kv_layers is None else window_group_split(self.kv_layers, itemsize)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "") -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        mtype = cfg.get("model_type", "")
        bias = cfg.get("attention_bias", cfg.get("enable_bias", mtype in ("qwen2", "opt")))
        return cls(
            name=name or cfg.get("_name_or_path", "") or cfg.get("model_type", "model"),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg.get("intermediate_size") or cfg["ffn_dim"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            mlp_matrices=2 if mtype in TWO_MATRIX_MLP else 3,
            kv_layers=tuple(layers_of_hf(cfg)) if mtype == "gemma4_text" else None,
        )


TWO_MATRIX_MLP = {"opt", "gpt2", "gpt_neox", "gptj", "bloom"}  # model_types with fc1/fc2 MLPs


# config.json fields of public models (Meta's and Qwen's published configs; no weights)
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                  "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "llama3-70b": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                   "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen2.5-32b": {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
                    "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # facebook/opt-13b and opt-66b config.json (DistServe's models; OPT ties lm_head)
    "opt-13b": {"model_type": "opt", "hidden_size": 5120, "num_hidden_layers": 40,
                "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272,
                "max_position_embeddings": 2048, "enable_bias": True,
                "tie_word_embeddings": True, "torch_dtype": "float16"},
    "opt-66b": {"model_type": "opt", "hidden_size": 9216, "num_hidden_layers": 64,
                "num_attention_heads": 72, "ffn_dim": 36864, "vocab_size": 50272,
                "max_position_embeddings": 2048, "enable_bias": True,
                "tie_word_embeddings": True, "torch_dtype": "float16"},
}  # fmt: skip


def load_model_config(spec: str) -> ModelShape:
    """A built-in name (llama3-8b, llama3-70b, qwen2.5-32b, opt-13b, opt-66b), a config.json,
    or a directory."""
    if spec.lower() in BUILTIN_CONFIGS:
        return ModelShape.from_config(BUILTIN_CONFIGS[spec.lower()], spec.lower())
    shipped = MODEL_CONFIG_DIR / f"{spec.lower()}.json"  # published configs (README there)
    if shipped.is_file():
        return ModelShape.from_config(json.loads(shipped.read_text()), spec.lower())
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        known = sorted(BUILTIN_CONFIGS) + sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))
        raise ValueError(f"unknown model config {spec!r}: {known} or a path")
    return ModelShape.from_config(json.loads(path.read_text()), path.parent.name)


QUANT_KV = ("fp8", "fp8_e4m3", "int8")


def kv_bytes_per_token_of(shape: ModelShape, kv_dtype: str, block_size: int = 16) -> int:
    """KV bytes per token in `kv_dtype`; a quantized one adds its per-block scales (as
    pdserve.kv.quant stores them: 4 bytes per block, K/V and kv head), rounded up."""
    base = shape.kv_bytes_per_token(itemsize_of(kv_dtype))
    if kv_dtype.lower() not in QUANT_KV:
        return base
    return base + -(-2 * shape.num_layers * shape.num_kv_heads * 4 // block_size)


def itemsize_of(dtype: str) -> int:
    return {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
            "fp8": 1, "fp8_e4m3": 1, "int8": 1}.get(dtype.lower(), 2)  # fmt: skip
