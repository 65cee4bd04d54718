"""Gemma 4 config parsing: what is honoured, what is refused (by name), the KV layout it
implies, and `pdserve model make-tiny --family gemma4`."""

from __future__ import annotations

import json

import pytest

from pdserve.errors import ModelLoadError
from pdserve.model.config import ModelConfig
from pdserve.model.tiny import TinySpec, hf_config, resolve


def _raw(**over):
    return hf_config(resolve(TinySpec(family="gemma4", vocab=512))) | over


def test_tiny_layout_shared_layers_store_nothing():
    c = ModelConfig.from_dict(_raw())
    g = c.gemma4
    assert g is not None and c.family == "gemma4"
    assert g.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert g.kv_source == (0, 1, 2, 3, 3, 2)  # the last 2 layers share the last of their type
    assert g.head_dims == (16, 16, 32, 16, 16, 32)
    assert g.kv_heads == (2, 2, 1, 2, 2, 1)
    assert g.k_eq_v == (False, False, True, False, False, True)
    assert g.intermediate == (192, 192, 192, 192, 384, 384)  # double-wide on shared layers
    stored = c.kv_layers()
    assert [s.source for s in stored] == [0, 1, 2, 3]
    assert [c.kv_cache_index(i) for i in range(6)] == [0, 1, 2, 3, 3, 2]
    assert [s.window for s in stored] == [24, 24, None, 24]


def test_global_kv_heads_only_with_k_eq_v():
    """transformers applies num_global_key_value_heads only when attention_k_eq_v is set."""
    c = ModelConfig.from_dict(_raw(attention_k_eq_v=False))
    assert c.gemma4 is not None and c.gemma4.kv_heads == (2,) * 6
    assert c.gemma4.head_dims[2] == 32


def test_per_layer_config_form():
    raw = _raw(per_layer_config={"2": {"head_dim": 8}, "5": {"num_key_value_heads": 4}})
    raw.pop("global_head_dim")
    g = ModelConfig.from_dict(raw).gemma4
    assert g is not None
    assert g.head_dims == (16, 16, 8, 16, 16, 16)
    assert g.kv_heads == (2, 2, 2, 2, 2, 4)


@pytest.mark.parametrize(
    "over, field",
    [
        (dict(enable_moe_block=True, num_experts=4), "enable_moe_block"),
        (dict(use_bidirectional_attention="all"), "use_bidirectional_attention"),
        (dict(hidden_activation="relu"), "hidden_activation"),
        (
            dict(
                rope_parameters={
                    "sliding_attention": {"rope_type": "yarn"},
                    "full_attention": {"rope_type": "default"},
                }
            ),
            "rope_type",
        ),
        (dict(per_layer_config={"1": {"sliding_window": 3}}), "sliding_window"),
        (dict(num_kv_shared_layers=6), "num_kv_shared_layers"),
        (dict(num_kv_shared_layers=5), "num_kv_shared_layers"),  # no full layer left to share
    ],
)
def test_refused_fields_are_named(over, field):
    with pytest.raises(ModelLoadError, match=field):
        ModelConfig.from_dict(_raw(**over))


def test_make_tiny_cli(tmp_path, capsys):
    from pdserve.cli.main import main
    from pdserve.model.loader import load_model

    assert (
        main(["model", "make-tiny", str(tmp_path / "g"), "--family", "gemma4", "--vocab", "400"])
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["family"] == "gemma4" and out["layers"] == 6
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "g" / f).is_file()
    loaded = load_model(tmp_path / "g")
    assert loaded.config.family == "gemma4"
    assert len(loaded.tokenizer.encode("hello world")) > 0


def test_chunked_prefill_and_keqv_cache(tmp_path):
    """Prefill in 7-token chunks (context read back from the cache: K rebuilt from the V-only
    K = V cache, sliding windows) gives the one-shot tokens and logits."""
    import random

    import torch

    from pdserve.model.loader import allocate_kv_caches, load_model
    from pdserve.model.tiny import make_tiny

    from .model_fixtures import run_paged

    loaded = load_model(make_tiny(tmp_path / "g", TinySpec(family="gemma4", vocab=512)))
    caches = allocate_kv_caches(loaded.config, 4, 16)
    assert [tuple(c.shape[1:]) for c in caches] == [(2, 16, 2, 16)] * 2 + [(1, 16, 1, 32)] + [
        (2, 16, 2, 16)
    ]
    rng = random.Random(5)
    prompts = [[rng.randrange(7, 512) for _ in range(n)] for n in (1, 15, 16, 17, 50)]
    whole = run_paged(loaded, prompts, 20, stagger=False)
    chunked = run_paged(loaded, prompts, 20, chunk=7, stagger=True)
    for a, b in zip(whole, chunked, strict=True):
        assert a.tokens == b.tokens
        torch.testing.assert_close(torch.stack(a.logits), torch.stack(b.logits), atol=1e-4, rtol=0)
