"""make-tiny: deterministic random llama-family checkpoints with a locally trained BPE.

`make_tiny(out_dir, TinySpec(...))` writes config.json, generation_config.json,
model.safetensors, tokenizer.json and tokenizer_config.json; the same spec gives the same
bytes in every file. The tokenizer is a byte-level BPE trained with `tokenizers` on the
prose under pdserve/model/data/*.txt; its vocabulary may stop short of `vocab` (the text is
small), and the model's extra rows get a zero lm_head row, so greedy never picks them.

Weights are scaled to make greedy decoding decisive (top-1/top-2 logit margins far above
float noise): linear weights N(0, 1/fan_in), lm_head N(0, 3^2/hidden) (logit std ~3),
norm weights 1 + N(0, 0.1^2), biases N(0, 0.1^2).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = [
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|end|>",
]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
FAMILY_ARCH = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "mistral": ("MistralForCausalLM", "mistral"),
    "gemma4": ("Gemma4ForCausalLM", "gemma4_text"),
}
DATA_DIR = Path(__file__).parent / "data"


@dataclass(frozen=True)
class TinySpec:
    family: str = "llama"
    seed: int = 0
    hidden: int = 64
    layers: int | None = None  # None = 2 (gemma4: 6, so that every Gemma 4 feature shows)
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 192
    vocab: int = 1024
    max_pos: int = 4096
    tie: bool = False
    dtype: str = "float32"
    head_dim: int | None = None  # None = hidden // heads (qwen3 default: 2 * that)
    sliding_window: int | None = None  # mistral default: 48
    rope_theta: float = 10000.0
    # gemma4 only: config.json keys set last (e.g. num_kv_shared_layers, attention_k_eq_v)
    gemma4_overrides: tuple[tuple[str, Any], ...] = ()


PRESETS = {
    # Llama-shaped, ~47M parameters (untied 16k vocab): the benchmark model
    "bench50m": TinySpec(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=2048, vocab=16384),
}


def resolve(spec: TinySpec) -> TinySpec:
    """Fill family defaults and validate."""
    if spec.family not in FAMILY_ARCH:
        raise ValueError(f"unknown family {spec.family!r}; choose from {sorted(FAMILY_ARCH)}")
    if spec.hidden % spec.heads or spec.heads % spec.kv_heads:
        raise ValueError("need hidden % heads == 0 and heads % kv_heads == 0")
    if spec.vocab < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab must be >= {256 + len(SPECIAL_TOKENS)} (bytes + special tokens)")
    if spec.dtype not in ("float32", "bfloat16"):
        raise ValueError("dtype must be float32 or bfloat16")
    head_dim = spec.head_dim or spec.hidden // spec.heads * (2 if spec.family == "qwen3" else 1)
    window = spec.sliding_window
    if spec.family == "mistral" and window is None:
        window = 48
    if spec.family == "gemma4" and window is None:
        window = 24
    layers = spec.layers or (6 if spec.family == "gemma4" else 2)
    return replace(spec, head_dim=head_dim, sliding_window=window, layers=layers)


def gemma4_config(spec: TinySpec) -> dict:
    """A tiny Gemma 4 text config in the published form (global_head_dim,
    num_global_key_value_heads): sliding, sliding, full repeated (the last layer full), the
    last third of the layers KV-shared, K = V on full layers with a double head dim and one KV
    head, per-layer inputs, double-wide MLP on shared layers, softcapped logits."""
    n = spec.layers or 6
    types = ["full_attention" if i % 3 == 2 else "sliding_attention" for i in range(n)]
    types[-1] = "full_attention"
    cfg = {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": n,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "global_head_dim": 2 * (spec.head_dim or 0),
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "num_kv_shared_layers": n // 3,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": spec.vocab,
        "layer_types": types,
        "sliding_window": spec.sliding_window,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": spec.rope_theta},
            "full_attention": {
                "rope_type": "proportional",
                "partial_rotary_factor": 0.25,
                "rope_theta": 1_000_000.0,
            },
        },
        "final_logit_softcapping": 30.0,
        "hidden_activation": "gelu_pytorch_tanh",
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_pos,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "attention_bias": False,
        "enable_moe_block": False,
        "use_bidirectional_attention": None,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": spec.dtype,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    return cfg | dict(spec.gemma4_overrides)


def hf_config(spec: TinySpec) -> dict:
    if spec.family == "gemma4":
        return gemma4_config(spec)
    arch, model_type = FAMILY_ARCH[spec.family]
    cfg = {
        "architectures": [arch],
        "model_type": model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "max_position_embeddings": spec.max_pos,
        "rms_norm_eps": 1e-6,
        "rope_theta": spec.rope_theta,
        "rope_scaling": None,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "torch_dtype": spec.dtype,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": True,
    }
    if spec.family in ("llama", "qwen3"):
        cfg["attention_bias"] = False
    if spec.family == "mistral":
        cfg["sliding_window"] = spec.sliding_window
    if spec.family in ("qwen2", "qwen3"):
        cfg |= {
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": spec.layers,
        }
    return cfg


def train_tokenizer(vocab: int):  # -> tokenizers.Tokenizer
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    texts = [p.read_text(encoding="utf-8") for p in sorted(DATA_DIR.glob("*.txt"))]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,  # ids 0.. in this order: bos=0, eos=1, pad=2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B", special_tokens=[("<|bos|>", 0)]
    )
    return tok


def init_weights(spec: TinySpec, tokenizer_vocab: int) -> dict[str, torch.Tensor]:
    """HF-named tensors, drawn in a fixed order from one seeded generator."""
    from pdserve.model.config import ModelConfig
    from pdserve.model.loader import expected_shapes

    gen = torch.Generator().manual_seed(spec.seed)
    shapes = expected_shapes(ModelConfig.from_dict(hf_config(spec)))
    out: dict[str, torch.Tensor] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("layer_scalar"):  # gemma4 per-layer output scale
            x = 1.0 + 0.2 * x.abs()
        elif "norm" in name:
            x = 1.0 + 0.1 * x
        elif name.endswith(".bias"):
            x = 0.1 * x
        elif name in ("lm_head.weight", "model.embed_tokens.weight"):
            x = x * (3.0 / spec.hidden**0.5)
        else:
            x = x / shape[1] ** 0.5
        out[name] = x
    head = "lm_head.weight" if "lm_head.weight" in out else "model.embed_tokens.weight"
    out[head][tokenizer_vocab:] = 0.0  # ids the tokenizer never produces: never the argmax
    dtype = torch.bfloat16 if spec.dtype == "bfloat16" else torch.float32
    return {k: v.to(dtype).contiguous() for k, v in out.items()}


def _dump(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_tiny(out_dir: str | Path, spec: TinySpec | None = None) -> Path:
    """Write a checkpoint directory (created if needed; existing files overwritten)."""
    from safetensors.torch import save_file

    spec = resolve(spec or TinySpec())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(spec.vocab)
    tok_vocab = tok.get_vocab_size(with_added_tokens=True)
    _dump(out / "config.json", hf_config(spec))
    end_id = tok.token_to_id("<|end|>")
    _dump(
        out / "generation_config.json",
        {"bos_token_id": 0, "eos_token_id": [1, end_id], "pad_token_id": 2},
    )
    save_file(
        init_weights(spec, tok_vocab), str(out / "model.safetensors"), metadata={"format": "pt"}
    )
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    _dump(
        out / "tokenizer_config.json",
        {
            "bos_token": "<|bos|>",
            "eos_token": "<|eos|>",
            "pad_token": "<|pad|>",
            "chat_template": CHAT_TEMPLATE,
            "model_max_length": spec.max_pos,
            "tokenizer_class": "PreTrainedTokenizerFast",
            "clean_up_tokenization_spaces": False,
        },
    )
    return out


BUILTIN_SPEC = TinySpec(family="llama", seed=0)
BUILTIN_NAME = "tiny-llama"
_REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def default_home() -> Path:
    return Path(os.environ.get("PDSERVE_HOME") or Path.home() / ".cache" / "pdserve")


def ensure_builtin_tiny(cache_dir: str | Path | None = None) -> Path:
    """The built-in tiny llama used by `pdserve up` without --model: `<cache_dir>/tiny-llama`
    (cache_dir default: $PDSERVE_HOME, else ~/.cache/pdserve). Created once; safe under
    concurrency: built in a temp dir beside the target, then renamed into place."""
    home = Path(cache_dir) if cache_dir is not None else default_home()
    target = home / BUILTIN_NAME
    if all((target / f).is_file() for f in _REQUIRED):
        return target
    home.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{BUILTIN_NAME}-", dir=home))
    try:
        make_tiny(tmp, BUILTIN_SPEC)
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race (or a partial dir is in the way)
            if not all((target / f).is_file() for f in _REQUIRED):
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
