"""The directory an emulated cluster loads: the modelled model's config.json (shapes, vocab,
context length) next to a real tokenizer's files. The router reads it as any checkpoint
(tokenizer, vocab, context length, EOS ids); emulated workers read its config.json.

The tokenizer is stated, never implied: `--tokenizer DIR`, else the `--model` directory's,
else the built-in tiny model's (a small BPE: text prompts work, generated ids above its
vocabulary decode to nothing). EOS/BOS ids come from the tokenizer's directory.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from pdserve.emulate.backend import read_model_config

_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja",
)  # fmt: skip
MARKER = "pdserve_emulated"


def make_emulated_dir(
    out: str | Path,
    model_config: str | None,
    tokenizer_dir: str | Path,
    model_dir: str | None = None,
    extra: dict[str, Any] | None = None,
) -> Path:
    """Write `out`/config.json (the modelled config, EOS/BOS of the tokenizer's model) and a
    copy of `tokenizer_dir`'s tokenizer files. Returns `out`."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok = Path(tokenizer_dir)
    raw = dict(read_model_config(model_config, model_dir))
    tok_cfg_path = tok / "config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    for key in ("eos_token_id", "bos_token_id"):
        if key in tok_cfg:
            raw[key] = tok_cfg[key]
    raw.setdefault("architectures", [_ARCH.get(raw.get("model_type", ""), "LlamaForCausalLM")])
    raw[MARKER] = {"model_config": model_config or model_dir, "tokenizer": str(tok.resolve()),
                   **(extra or {})}  # fmt: skip
    copied = 0
    for name in _TOKENIZER_FILES:
        if (tok / name).is_file():
            shutil.copyfile(tok / name, out / name)
            copied += name.startswith("tokenizer")
    if not copied:
        raise ValueError(f"no tokenizer files in {tok}")
    (out / "config.json").write_text(json.dumps(raw, indent=1))
    return out


_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "mistral": "MistralForCausalLM"}  # fmt: skip


def wire_ratio(model_dir: str | Path, block_size: int = 16, wire_layers: int = 1) -> float:
    """Wire bytes per modelled KV byte (for sizing a kvstore in modelled bytes)."""
    from pdserve.costmodel.shapes import ModelShape, itemsize_of

    raw = json.loads((Path(model_dir) / "config.json").read_text())
    modelled = ModelShape.from_config(raw).kv_bytes_per_token(itemsize_of("bfloat16"))
    wire = 2 * block_size * 2 * wire_layers  # float16, 1 kv head, head_dim 1
    return wire / (modelled * block_size)
