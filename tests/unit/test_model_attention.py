"""Torch attention backend vs a naive dense reference on a paged cache: mixed batches of
fresh prefills, chunks after cached context and decodes; GQA/MQA; sliding windows."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.model.attention import AttentionMetadata, TorchAttentionBackend, select_backend
from pdserve.model.config import ModelConfig
from pdserve.model.loader import allocate_kv_caches

BS = 16


def _reference(q, k_ctx, v_ctx, window):
    """q: [Tq, H, D] at the last Tq positions of a context k/v: [S, Hkv, D]."""
    tq, h, d = q.shape
    s, hkv, _ = k_ctx.shape
    k = k_ctx.repeat_interleave(h // hkv, dim=1)  # [S, H, D]
    v = v_ctx.repeat_interleave(h // hkv, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / d**0.5
    qpos = torch.arange(s - tq, s)[:, None]
    kpos = torch.arange(s)[None, :]
    ok = kpos <= qpos
    if window is not None:
        ok &= kpos > qpos - window
    scores = scores.masked_fill(~ok, float("-inf"))
    return torch.einsum("hts,shd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 2, None), (4, 1, 7), (6, 6, 20)])
def test_torch_backend_matches_reference(heads, kv_heads, window):
    torch.manual_seed(0)
    rng = random.Random(heads * 10 + kv_heads)
    d = 8
    backend = TorchAttentionBackend(heads, kv_heads, d)
    # (cached context, new tokens): decodes, fresh prefills, chunks after cached context
    shapes = [(30, 1), (0, 17), (5, 1), (16, 16), (0, 1), (33, 9), (47, 1)]
    num_blocks = sum(-(-(c + n) // BS) for c, n in shapes) + 3
    cache = torch.zeros(num_blocks, 2, BS, kv_heads, d)
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables, full_k, full_v = [], [], []
    for c, n in shapes:
        table = [free.pop() for _ in range(-(-(c + n) // BS))]
        tables.append(table)
        k, v = torch.randn(c + n, kv_heads, d), torch.randn(c + n, kv_heads, d)
        full_k.append(k)
        full_v.append(v)
        for pos in range(c):  # the cached prefix is already in the cache
            cache[table[pos // BS], 0, pos % BS] = k[pos]
            cache[table[pos // BS], 1, pos % BS] = v[pos]
    meta = AttentionMetadata.build([n for _, n in shapes], [c + n for c, n in shapes], tables, BS)
    q = torch.randn(meta.num_tokens, heads, d)
    k_new = torch.cat([k[c:] for k, (c, _) in zip(full_k, shapes, strict=True)])
    v_new = torch.cat([v[c:] for v, (c, _) in zip(full_v, shapes, strict=True)])
    out = backend.forward(backend.prepare(meta), q, k_new, v_new, cache, window)
    start = 0
    for (c, n), k, v, table in zip(shapes, full_k, full_v, tables, strict=True):
        ref = _reference(q[start : start + n], k, v, window)
        torch.testing.assert_close(out[start : start + n], ref, atol=1e-5, rtol=1e-5)
        pos = c + n - 1  # the new tokens were written into the cache
        torch.testing.assert_close(cache[table[pos // BS], 1, pos % BS], v[pos])
        start += n


def test_metadata_build_and_errors():
    meta = AttentionMetadata.build([3, 1], [3, 18], [[4], [2, 9]], BS)
    assert meta.slot_mapping.tolist() == [64, 65, 66, 9 * 16 + 1]
    assert meta.query_start_loc.tolist() == [0, 3, 4]
    assert (meta.num_prefill_tokens, meta.num_decode_tokens) == (3, 1)
    assert meta.block_tables.tolist() == [[4, 0], [2, 9]]
    with pytest.raises(ValueError, match="too short"):
        AttentionMetadata.build([1], [17], [[1]], BS)
    with pytest.raises(ValueError, match="query_len <= seq_len"):
        AttentionMetadata.build([5], [4], [[1]], BS)


def test_select_backend_and_kv_caches():
    assert select_backend("cpu", 4, 2, 16).name == "torch"
    with pytest.raises(ValueError, match="cuda"):
        select_backend("cpu", 4, 2, 16, name="flashinfer")
    cfg = ModelConfig.from_dict(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 64,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "num_hidden_layers": 3,
            "vocab_size": 300,
            "intermediate_size": 128,
        }
    )
    caches = allocate_kv_caches(cfg, 10, BS, "bfloat16")
    assert len(caches) == 3
    assert caches[0].shape == (10, 2, BS, 2, 16) and caches[0].dtype == torch.bfloat16
