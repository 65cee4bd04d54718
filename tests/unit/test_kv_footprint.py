"""kv.footprint is the one formula for KV bytes by stage: the engine's KVSpec (cache blocks,
transfer sizes) and the simulator's ModelShape agree with it, and hand-computed Gemma 4 sizes
match (the serving test checks the same numbers against UCX byte counters)."""

from __future__ import annotations

import pytest

from pdserve.kv import store_parts
from pdserve.kv.footprint import KVLayer, kv_bytes, kv_bytes_per_token, layers_of, report
from pdserve.kv.spec import KVSpec, LayerKV
from pdserve.model.config import ModelConfig
from pdserve.model.tiny import TinySpec, hf_config, resolve

BS = 16


def _config(family: str, **kw) -> ModelConfig:
    return ModelConfig.from_dict(hf_config(resolve(TinySpec(family=family, vocab=512, **kw))))


def _spec(c: ModelConfig, dtype: str = "float32") -> KVSpec:
    stored = [
        LayerKV(s.num_kv_heads, s.head_dim, s.window, 1 if s.k_eq_v else 2) for s in c.kv_layers()
    ]
    return KVSpec.for_layers(stored, BS, dtype)


@pytest.mark.parametrize("n", [1, 15, 16, 17, 24, 40, 41, 50, 300])
def test_engine_spec_agrees_with_footprint(n):
    c = _config("gemma4")
    spec, layers = _spec(c), layers_of(c)
    one_pool = kv_bytes(layers, n, 4, BS, "one_pool")
    assert spec.bytes_per_block * spec.num_blocks_for(n) == one_pool
    assert spec.transfer_bytes(n) == kv_bytes(layers, n, 4, BS, "transfer")
    # the window pool: main-group blocks for every token, window-group blocks for the window
    full_b, win_b = spec.group_block_bytes()
    nb = spec.num_blocks_for(n)
    # the kvstore: main parts of every block, window parts of the last window_blocks blocks
    assert store_parts.part_bytes(spec) == (full_b, win_b)
    stored = full_b * nb + win_b * min(nb, store_parts.window_blocks(spec))
    assert kv_bytes(layers, n, 4, BS, "store") == stored
    held = full_b * nb + win_b * (nb - max(0, n - spec.window_group) // BS)
    assert held == kv_bytes(layers, n, 4, BS, "cache")


def test_tiny_gemma4_by_hand():
    """6 layers: sliding (2 KV heads x 16) at 0, 1, 3; full (1 x 32, K = V) at 2; layers 4, 5
    share 3 and 2. fp32; a K+V block of either shape is 2 * 16 * 32 * 4 = 4096 bytes."""
    layers = layers_of(_config("gemma4"))
    blk = 2 * BS * 32 * 4
    n = 50  # 4 blocks; window 24 keeps blocks from (50 - 24) // 16 = 1 on
    half = blk // 2  # the K = V layer keeps V only
    assert kv_bytes(layers, n, 4, BS, "naive") == 6 * 4 * blk
    assert kv_bytes(layers, n, 4, BS, "one_pool") == 3 * 4 * blk + 4 * half
    assert kv_bytes(layers, n, 4, BS, "transfer") == 3 * 3 * blk + 4 * half
    assert kv_bytes(layers, n, 4, BS, "cache") == kv_bytes(layers, n, 4, BS, "transfer")
    # the store: sliding layers keep ceil(24 / 16) + 1 = 3 blocks, the K = V layer all 4
    assert kv_bytes(layers, n, 4, BS, "store") == 3 * 3 * blk + 4 * half
    assert kv_bytes(layers, 16, 4, BS, "store") == 3 * 1 * blk + 1 * half  # fewer blocks
    r = report(layers, 4, n)
    assert r["transfer"]["vs_naive"] == pytest.approx(11 / 24)


def test_uniform_models_keep_layout_and_fingerprint():
    c = _config("llama")
    spec = _spec(c)
    assert spec.layers is None and spec.num_layers == c.num_layers
    old = KVSpec(c.num_layers, c.num_kv_heads, c.head_dim, BS, "float32")
    assert spec.kv_fingerprint("m") == old.kv_fingerprint("m")
    per_token = 2 * c.num_layers * c.num_kv_heads * c.head_dim * 2
    assert kv_bytes_per_token(layers_of(c), 2, "cache", context=64) == per_token
    assert kv_bytes_per_token(layers_of(c), 2, "one_pool", context=64) == per_token
    # Mistral (one shape, a window on every layer) keeps the uniform spec: its transfer
    # still moves every block (trimming applies to layered specs only, see KVSpec.for_layers)
    mistral = _spec(_config("mistral"))
    assert mistral.layers is None and mistral.window_group is None
    assert mistral.transfer_bytes(200) == mistral.bytes_per_block * 13
    m_layers = layers_of(_config("mistral"))
    assert store_parts.window_blocks(mistral) == 0  # the kvstore keeps whole blocks too
    for stage in ("cache", "transfer"):  # one pool, whole transfers: nothing trimmed
        assert kv_bytes(m_layers, 200, 4, BS, stage) == kv_bytes(m_layers, 200, 4, BS, "store")


def test_layered_fingerprint_names_layer_shapes():
    a = KVSpec.for_layers([LayerKV(2, 16, 24), LayerKV(1, 32)], BS, "float32")
    b = KVSpec.for_layers([LayerKV(2, 16, 48), LayerKV(1, 32)], BS, "float32")
    assert a.layers is not None and a.kv_fingerprint("m") != b.kv_fingerprint("m")
    assert a.blocks_shape(3) == (3, 2 * BS * (2 * 16 + 32))
    with pytest.raises(ValueError, match="layer_block_shape"):
        _ = a.block_shape


def test_sim_uses_footprint_for_layered_models():
    from pdserve.costmodel.shapes import MODEL_CONFIG_DIR, layers_of_hf, load_model_config

    for name in ("gemma4-31b", "gemma4-e2b"):
        shape = load_model_config(name)
        import json

        layers = layers_of_hf(json.loads((MODEL_CONFIG_DIR / f"{name}.json").read_text()))
        assert shape.kv_layers == tuple(layers)
        assert shape.kv_bytes_per_token(2) == round(kv_bytes_per_token(layers, 2, "one_pool"))
        naive = kv_bytes_per_token(layers, 2, "naive")
        assert kv_bytes_per_token(layers, 2, "transfer") < naive
    e2b = layers_of_hf(json.loads((MODEL_CONFIG_DIR / "gemma4-e2b.json").read_text()))
    assert sum(x.shared for x in e2b) == 20  # KV-shared layers hold nothing in the cache


def test_unknown_stage():
    with pytest.raises(ValueError, match="stage"):
        kv_bytes([KVLayer(1, 8)], 4, 2, BS, "disk")
