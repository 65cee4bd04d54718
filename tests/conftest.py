"""Shared fixtures: tiny checkpoints (made with transformers, and with pdserve.model.tiny when
it exists), and a transformers greedy reference. Tiny = hidden 64, 2 layers, vocab 512."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# Services a test starts by hand (or in-process) run without TLS on the internal plane: they
# test one component, not the security of a cluster. The cluster fixtures (pdserve.launcher)
# always pass --tls-dir or --insecure explicitly, and run mutual TLS by default.
os.environ.setdefault("PDSERVE_INSECURE", "1")
# The suite compares tokens exactly (services vs the in-process engine, engine vs transformers
# in fp32). The serving default dtype is "auto" (bfloat16 on a CPU with AVX512-BF16/AMX), so pin
# float32 for workers started by tests (WorkerSettings reads PDSERVE_DTYPE) and `pdserve
# generate`; in-process EngineConfigs in tests pass dtype explicitly.
os.environ.setdefault("PDSERVE_DTYPE", "float32")

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
VOCAB = 512
SLIDING_WINDOW = 24  # small so the window bites in mistral tests


def build_hf_checkpoint(path: Path, family: str = "llama", seed: int = 0) -> Path:
    """A tiny random checkpoint written by transformers itself (`save_pretrained`). The init
    scale (0.2) makes greedy decoding decisive (top-2 logit margins well above fp32 noise)."""
    import torch
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.2,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    if family == "llama":
        cfg, cls = tf.LlamaConfig(**common), tf.LlamaForCausalLM
    elif family == "qwen2":  # attention bias on q/k/v; tied embeddings; MQA
        common.update(tie_word_embeddings=True, num_key_value_heads=1)
        cfg, cls = tf.Qwen2Config(**common), tf.Qwen2ForCausalLM
    elif family == "qwen3":  # q/k norm; head_dim != hidden / heads
        cfg, cls = tf.Qwen3Config(head_dim=32, **common), tf.Qwen3ForCausalLM
    elif family == "mistral":
        cfg, cls = tf.MistralConfig(sliding_window=SLIDING_WINDOW, **common), tf.MistralForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    model.save_pretrained(path)
    return path


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int):
    """transformers' greedy `generate` (eager attention, no EOS stop).
    Returns (new token ids, per-step logits [max_new_tokens, vocab])."""
    import torch

    model = _hf_model(str(model_dir))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.stack([s[0] for s in out.scores])


_HF_CACHE: dict[str, object] = {}


def _hf_model(model_dir: str):
    import transformers as tf

    if model_dir not in _HF_CACHE:
        _HF_CACHE[model_dir] = tf.AutoModelForCausalLM.from_pretrained(
            model_dir, attn_implementation="eager"
        ).eval()
    return _HF_CACHE[model_dir]


def assert_greedy_matches(ours: list[int], ref: list[int], ref_logits, tie: float = 1e-4):
    """Equal token for token, except a divergence right after a true near-tie in the
    reference logits (top-2 margin < tie) is forgiven from that point on."""
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            top2 = ref_logits[i].topk(2).values
            margin = float(top2[0] - top2[1])
            assert margin < tie, f"token {i}: ours {a} != ref {b} (ref margin {margin:.3g})"
            return


def has_tiny() -> bool:
    return importlib.util.find_spec("pdserve.model.tiny") is not None


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf-ckpt")
    return {f: build_hf_checkpoint(root / f, f) for f in FAMILIES}


@pytest.fixture(scope="session")
def tiny_llama_dir(hf_checkpoints) -> Path:
    return hf_checkpoints["llama"]


@pytest.fixture(scope="session")
def make_tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints from `pdserve model make-tiny` (skips while pdserve.model.tiny is absent)."""
    if not has_tiny():
        pytest.skip("pdserve.model.tiny not available yet")
    from pdserve.model import tiny

    root = tmp_path_factory.mktemp("make-tiny")
    out = {}
    for family in FAMILIES:
        spec = tiny.TinySpec(family=family, seed=0, vocab=VOCAB, max_pos=512)
        out[family] = Path(tiny.make_tiny(root / family, spec))
    return out


@pytest.fixture(scope="session")
def loaded_llama(tiny_llama_dir):
    from pdserve.model.loader import load_model

    return load_model(tiny_llama_dir, dtype="float32")


@pytest.fixture
def make_engine(loaded_llama):
    """Factory for engines sharing one loaded tiny llama (or `loaded=`); checks block accounting
    returns to its initial state at teardown (every block of every pool free, integrity holds)."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    engines = []

    def factory(loaded=None, **kw):
        loaded = loaded or loaded_llama
        kw.setdefault("num_blocks", 256)
        kw.setdefault("block_size", 16)
        kw.setdefault("max_num_batched_tokens", 256)
        kw.setdefault("max_num_seqs", 32)
        engine = LLMEngine(EngineConfig(model_dir=loaded.model_dir, **kw), loaded=loaded)
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        assert not engine.has_unfinished_requests()
        engine.check_integrity()
        assert engine.kv.num_free_blocks == engine.num_blocks
        assert engine.kv.num_free_window_blocks == engine.kv.num_window_blocks  # 0 == 0: one pool
