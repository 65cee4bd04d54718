"""Helpers for the model-level tests: build tiny checkpoints with transformers, drive our model
through a paged KV cache with a minimal block table, and run transformers' greedy generate."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from pdserve.model.attention import AttentionMetadata
from pdserve.model.loader import LoadedModel, allocate_kv_caches
from pdserve.model.tiny import TinySpec, make_tiny

BLOCK_SIZE = 16
PROMPT_LENS = (1, 15, 16, 17, 50)


def decisive_init_(model: torch.nn.Module, seed: int, hidden: int) -> None:
    """Re-draw an HF model's weights so greedy decoding is decisive (see model/tiny.py)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            x = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                x = 1.0 + 0.1 * x
            elif name.endswith(".bias"):
                x = 0.1 * x
            elif "embed_tokens" in name or "lm_head" in name:
                x = x * (3.0 / hidden**0.5)
            else:
                x = x / p.shape[1] ** 0.5
            p.copy_(x)


def hf_checkpoint(
    out: Path, family: str, seed: int = 0, tokenizer_from: Path | None = None, **overrides
) -> Path:
    """Save a tiny transformers model of `family` to `out` (+ a tokenizer.json copied from a
    make-tiny dir, so the directory is a complete checkpoint)."""
    import transformers as tf

    cls = {
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM"),
    }[family]
    kw = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
    )
    kw |= overrides
    config = getattr(tf, cls[0])(**kw)
    torch.manual_seed(seed)
    model = getattr(tf, cls[1])(config)
    decisive_init_(model, seed, kw["hidden_size"])
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():  # gemma4's per-layer output scalars are buffers: vary them too
        for name, buf in model.named_buffers():
            if name.endswith("layer_scalar"):
                buf.copy_(1.0 + 0.2 * torch.rand(buf.shape, generator=gen))
    model.save_pretrained(out)
    if tokenizer_from is not None:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer_from / f, out / f)
    return out


def tiny_checkpoint(out: Path, **spec) -> Path:
    return make_tiny(out, TinySpec(**spec))


def load_hf(model_dir: Path, dtype: torch.dtype = torch.float32, attn: str = "eager"):
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype, attn_implementation=attn
    )
    return model.eval()


@dataclass
class SeqRun:
    prompt: list[int]
    tokens: list[int]  # greedy tokens we produced
    logits: list[torch.Tensor]  # [vocab] float32 logits that chose each token
    prompt_logits: torch.Tensor | None = None  # [len(prompt), vocab] when prefilled in one chunk


def run_paged(
    loaded: LoadedModel,
    prompts: list[list[int]],
    new_tokens: int,
    chunk: int | None = None,
    stagger: bool = True,
) -> list[SeqRun]:
    """Greedy-decode all prompts together through the paged cache. Sequence i joins at step i
    when `stagger` (so steps mix prefill chunks and decodes); prompts are prefilled in chunks
    of `chunk` tokens (None = whole prompt). Blocks are handed out in reverse order so block
    tables are not the identity."""
    cfg = loaded.config
    need = [-(-(len(p) + new_tokens) // BLOCK_SIZE) for p in prompts]
    num_blocks = sum(need) + 1
    caches = allocate_kv_caches(cfg, num_blocks, BLOCK_SIZE, loaded.dtype, loaded.device)
    free = list(range(num_blocks - 1, 0, -1))  # block 0 unused (padding target)
    tables = [[free.pop() for _ in range(n)][::-1] for n in need]
    runs = [SeqRun(p, [], []) for p in prompts]
    done = [0] * len(prompts)  # tokens of each sequence already in the cache
    step = 0
    with torch.inference_mode():
        while any(len(r.tokens) < new_tokens for r in runs):
            ids, pos, qlens, slens, tbls, members = [], [], [], [], [], []
            for i, r in enumerate(runs):
                if (stagger and i > step) or len(r.tokens) >= new_tokens:
                    continue
                seq = r.prompt + r.tokens
                if done[i] < len(r.prompt):
                    n = (
                        len(r.prompt) - done[i]
                        if chunk is None
                        else min(chunk, len(r.prompt) - done[i])
                    )
                else:
                    n = 1
                ids += seq[done[i] : done[i] + n]
                pos += range(done[i], done[i] + n)
                qlens.append(n)
                slens.append(done[i] + n)
                tbls.append(tables[i])
                members.append(i)
            meta = AttentionMetadata.build(qlens, slens, tbls, BLOCK_SIZE, loaded.device)
            hidden = loaded.model(
                torch.tensor(ids, device=loaded.device),
                torch.tensor(pos, device=loaded.device),
                caches,
                meta,
            )
            start = 0
            for i, q in zip(members, qlens, strict=True):
                r = runs[i]
                done[i] += q
                if q == len(r.prompt) and not r.tokens:
                    r.prompt_logits = loaded.model.compute_logits(hidden[start : start + q]).cpu()
                if done[i] >= len(r.prompt):
                    logit = loaded.model.compute_logits(hidden[start + q - 1 : start + q])[0].cpu()
                    r.logits.append(logit)
                    r.tokens.append(int(logit.argmax()))
                start += q
            step += 1
    return runs


def hf_generate(model, prompt: list[int], new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers greedy generate (no EOS stop); returns tokens and per-step logits."""
    from transformers import GenerationConfig

    model.generation_config.eos_token_id = None  # never stop early: compare every step
    gc = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=0,
        eos_token_id=None,
        pad_token_id=0,
        bos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=gc,
        )
    toks = out.sequences[0, len(prompt) :].tolist()
    return toks, [lg[0].float() for lg in out.logits]


def top2_margin(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])
