"""load_model(dir, dtype, device) -> LoadedModel: HF checkpoint directory -> LlamaModel.

Reads config.json (+ generation_config.json), every *.safetensors file (or the files named
by model.safetensors.index.json), checks names and shapes against the config, fuses q/k/v
and gate/up, and materialises the model. Every failure is a ModelLoadError naming the file
or tensor at fault.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from pdserve.dtypes import DTYPE_NAMES, torch_dtype
from pdserve.errors import ModelLoadError
from pdserve.kv.spec import QUANT_KV_DTYPES
from pdserve.model import gemma4_weights
from pdserve.model.attention import AttentionBackend
from pdserve.model.config import ModelConfig
from pdserve.model.gemma4 import Gemma4Model
from pdserve.model.llama import LlamaModel

FULL_HASH_LIMIT = 256 << 20  # files up to this size are hashed in full
SAMPLE_CHUNK = 1 << 20
SAMPLE_COUNT = 16
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints carry


@dataclass
class LoadedModel:
    model: LlamaModel | Gemma4Model
    config: ModelConfig
    fingerprint: str  # hex; see model_fingerprint
    dtype: torch.dtype
    device: torch.device
    model_dir: Path

    @cached_property
    def tokenizer(self):  # -> pdserve.model.tokenizer.Tokenizer; ModelLoadError if missing
        from pdserve.model.tokenizer import Tokenizer

        return Tokenizer.from_dir(self.model_dir)


def auto_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The serving dtype `--dtype auto` picks for a device: bfloat16 where it is the faster
    one, else float32. CPU: bfloat16 when oneDNN runs packed bf16 linears natively (AVX512-BF16
    or AMX; measured ~1.7x fp32 prefill and ~1.8x fp32 decode on the bench50m preset, see
    docs/studies/cpu-kernels.md "bf16 against fp32"); CUDA: bfloat16 when the GPU supports it."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        from pdserve.model.cpu_linear import cpu_has_native_bf16, packing_supported

        native = cpu_has_native_bf16() and packing_supported(torch.bfloat16)
        return torch.bfloat16 if native else torch.float32
    return torch.float32


def resolve_dtype(
    dtype: str | torch.dtype | None, config: ModelConfig, device: str | torch.device = "cpu"
) -> torch.dtype:
    """None = the checkpoint's torch_dtype; "auto" = auto_dtype(device); else a DTYPE_NAMES name."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype(device)
    name = dtype or config.torch_dtype
    if name not in DTYPE_NAMES:
        raise ModelLoadError(
            f"unsupported dtype {name!r}; use auto or one of {sorted(DTYPE_NAMES)}"
        )
    return torch_dtype(name)


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError) as exc:
            raise ModelLoadError(f"bad {index.name}: {exc}") from exc
        files = [model_dir / n for n in names]
        for f in files:
            if not f.is_file():
                raise ModelLoadError(f"missing weight shard {f.name} (named by {index.name})")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {model_dir}")
    return files


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, derived from the config."""
    if c.gemma4 is not None:
        return gemma4_weights.expected_shapes(c)
    h, d, i = c.hidden_size, c.head_dim, c.intermediate_size
    q, kv = c.num_heads * d, c.num_kv_heads * d
    out: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, h)
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        out |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if c.attention_bias:
            out |= {
                p + f"self_attn.{x}_proj.bias": (s,) for x, s in (("q", q), ("k", kv), ("v", kv))
            }
        if c.o_proj_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if c.mlp_bias:
            out |= {
                p + f"mlp.{x}_proj.bias": (s,) for x, s in (("gate", i), ("up", i), ("down", h))
            }
        if c.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    return out


def read_checked(
    files: list[Path], config: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    want = expected_shapes(config)
    got: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    if name.endswith(IGNORED_SUFFIXES):
                        continue
                    if config.gemma4 is not None and gemma4_weights.ignored(name, config):
                        continue
                    if name == "lm_head.weight" and config.tie_word_embeddings:
                        continue  # tied: some checkpoints still store the copy
                    if name not in want:
                        raise ModelLoadError(f"unexpected tensor {name!r} in {f.name}")
                    shape = tuple(st.get_slice(name).get_shape())
                    if shape != want[name]:
                        raise ModelLoadError(
                            f"tensor {name!r} in {f.name} has shape {list(shape)}, "
                            f"config expects {list(want[name])}"
                        )
                    got[name] = st.get_tensor(name).to(dtype)
        except SafetensorError as exc:
            raise ModelLoadError(f"unreadable safetensors file {f.name}: {exc}") from exc
    missing = sorted(set(want) - set(got))
    if missing:
        more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ModelLoadError(f"missing tensor(s) {missing[:5]}{more}")
    return got


def fuse(hf: dict[str, torch.Tensor], c: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> LlamaModel state dict (fused qkv_proj and gate_up_proj)."""
    if c.gemma4 is not None:
        return gemma4_weights.fuse(hf, c)
    sd = {
        "embed_tokens.weight": hf["model.embed_tokens.weight"],
        "norm.weight": hf["model.norm.weight"],
    }
    if not c.tie_word_embeddings:
        sd["lm_head.weight"] = hf["lm_head.weight"]
    for n in range(c.num_layers):
        p, o = f"model.layers.{n}.", f"layers.{n}."
        a, m = p + "self_attn.", p + "mlp."
        sd[o + "input_layernorm.weight"] = hf[p + "input_layernorm.weight"]
        sd[o + "post_attention_layernorm.weight"] = hf[p + "post_attention_layernorm.weight"]
        sd[o + "qkv_proj.weight"] = torch.cat([hf[a + f"{x}_proj.weight"] for x in "qkv"])
        sd[o + "o_proj.weight"] = hf[a + "o_proj.weight"]
        sd[o + "gate_up_proj.weight"] = torch.cat(
            [hf[m + "gate_proj.weight"], hf[m + "up_proj.weight"]]
        )
        sd[o + "down_proj.weight"] = hf[m + "down_proj.weight"]
        if c.attention_bias:
            sd[o + "qkv_proj.bias"] = torch.cat([hf[a + f"{x}_proj.bias"] for x in "qkv"])
        if c.o_proj_bias:
            sd[o + "o_proj.bias"] = hf[a + "o_proj.bias"]
        if c.mlp_bias:
            sd[o + "gate_up_proj.bias"] = torch.cat(
                [hf[m + "gate_proj.bias"], hf[m + "up_proj.bias"]]
            )
            sd[o + "down_proj.bias"] = hf[m + "down_proj.bias"]
        if c.qk_norm:
            sd[o + "q_norm.weight"] = hf[a + "q_norm.weight"]
            sd[o + "k_norm.weight"] = hf[a + "k_norm.weight"]
    return sd


def model_fingerprint(files: list[Path], config: ModelConfig, dtype: torch.dtype) -> str:
    """sha256 hex over: architecture, dtype, the canonical config, and per weight file (in
    name order) its name, size and bytes. Files over FULL_HASH_LIMIT contribute their
    safetensors header (8-byte length + JSON) and SAMPLE_COUNT evenly spaced 1 MiB samples
    instead of every byte. Independent of the directory's location."""
    h = hashlib.sha256()
    h.update(f"{config.architecture}|{str(dtype).removeprefix('torch.')}|".encode())
    h.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    for f in files:
        size = f.stat().st_size
        h.update(f"|{f.name}|{size}|".encode())
        with f.open("rb") as fh:
            if size <= FULL_HASH_LIMIT:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
                continue
            head = fh.read(8)
            h.update(head + fh.read(int.from_bytes(head, "little")))
            for k in range(SAMPLE_COUNT):
                fh.seek((size - SAMPLE_CHUNK) * k // (SAMPLE_COUNT - 1))
                h.update(fh.read(SAMPLE_CHUNK))
    return h.hexdigest()


def load_model(
    model_dir: str | Path,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device = "cpu",
    backend: AttentionBackend | None = None,
) -> LoadedModel:
    """dtype None = the checkpoint's own torch_dtype, "auto" = the device's serving default
    (auto_dtype). Parameters never require grad."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_dir(model_dir)
    device = torch.device(device)
    tdtype = resolve_dtype(dtype, config, device)
    files = weight_files(model_dir)
    sd = fuse(read_checked(files, config, tdtype), config)
    cls = Gemma4Model if config.gemma4 is not None else LlamaModel
    model = cls(config, device=device, dtype=tdtype, backend=backend)
    model.load_state_dict({k: v.to(device) for k, v in sd.items()}, strict=True, assign=True)
    model.requires_grad_(False)
    model.eval()
    return LoadedModel(
        model=model,
        config=config,
        fingerprint=model_fingerprint(files, config, tdtype),
        dtype=tdtype,
        device=device,
        model_dir=model_dir,
    )


def allocate_kv_caches(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
) -> list[torch.Tensor]:
    """Per layer that stores KV (config.kv_layers(): KV-shared layers store none) a zeroed
    [num_blocks, 2, block_size, its num_kv_heads, its head_dim] tensor (1 instead of 2 on a
    K = V layer: V only); for a quantized KV dtype ("int8", "fp8_e4m3") a raw
    [num_blocks, row_bytes] one (kv/quant.py; uniform layouts only, see KVSpec)."""
    if isinstance(dtype, str) and dtype in QUANT_KV_DTYPES:
        from pdserve.kv import quant

        kvh, hd = config.num_kv_heads, config.head_dim
        return [
            quant.allocate(dtype, num_blocks, block_size, kvh, hd, device)
            for _ in config.kv_layers()
        ]
    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    return [
        torch.zeros((num_blocks, 1 if kv.k_eq_v else 2, block_size, kv.num_kv_heads, kv.head_dim), dtype=dtype,
                    device=device)
        for kv in config.kv_layers()
    ]  # fmt: skip
