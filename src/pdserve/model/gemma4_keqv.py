"""Attention for Gemma 4's K = V layers over a one-tensor paged cache.

On a K = V layer (attention_k_eq_v, full-attention layers) one projection p = k_proj(x) gives
both sides: V = v_norm(p) (RMS norm, no scale) and K = rope(k_norm(p)) = rope(w * V), where w is
k_norm's weight. So the cache keeps V only, `[num_blocks, 1, block_size, kv_heads, head_dim]`,
half the bytes, and K is rebuilt on read: one multiply by w and one RoPE over the gathered
context per layer and step (the decode cost, measured in docs/studies/gemma4-kv.md). In float32 the
rebuilt K equals transformers' bit for bit (the same products in the same order).

Built only from AttentionMetadata (not from a backend's private plan), so it works whichever
backend runs the other layers; q heads read kv head h // (H / Hkv) as everywhere.

Batch invariance (`invariant=True`, the engine's default): each sequence attends alone through
`attention.fixed.attend_sequence` (fixed reduction order, keys tiled from position 0), and a
chunk that is its whole context rebuilds K from its V in the cache dtype exactly as a later
read does, so a row's bits do not depend on the batch, the chunking or decode vs prefill.
`invariant=False` is the SDPA path (the batch-variant `--no-batch-invariant` mode).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve.model.attention import AttentionMetadata
from pdserve.model.attention.fixed import attend_sequence
from pdserve.model.llama import apply_rope


@dataclass
class KEqVPlan:
    slots: torch.Tensor  # [T] row of each new token in cache.view(-1, Hkv, D)
    dec_tok: torch.Tensor | None  # [Bd] token index of each decode sequence
    dec_rows: torch.Tensor | None  # [Bd, S_max] rows of each decode context (pad -> row 0)
    dec_mask: torch.Tensor | None  # [Bd, 1, 1, S_max] True = visible
    dec_lens: list[int] = field(default_factory=list)  # context length of each decode sequence
    prefills: list[tuple[int, int, int, torch.Tensor | None, torch.Tensor]] = field(
        default_factory=list
    )  # (start, end, seq_len, context rows or None when the chunk is the context, mask [Tq, S])


def plan_keqv(meta: AttentionMetadata) -> KEqVPlan:
    """Once per step (full attention: no window)."""
    bs, dev = meta.block_size, meta.slot_mapping.device
    dec, dec_tok, prefills, start = [], [], [], 0
    for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        if q == 1:
            dec.append(i)
            dec_tok.append(start)
        else:
            rows = None if q == s else _rows(meta.block_tables_cpu[i], s, bs).to(dev)
            qpos = torch.arange(s - q, s, device=dev)[:, None]
            mask = torch.arange(s, device=dev)[None, :] <= qpos
            prefills.append((start, start + q, s, rows, mask))
        start += q
    plan = KEqVPlan(meta.slot_mapping.to(torch.int64), None, None, None, prefills=prefills)
    if dec:
        plan.dec_lens = [meta.seq_lens_cpu[i] for i in dec]
        lens = torch.tensor(plan.dec_lens, dtype=torch.int64)
        s_max = int(lens.max())
        plan.dec_rows = torch.stack(
            [_rows(meta.block_tables_cpu[i], s_max, bs, pad=True) for i in dec]
        ).to(dev)
        plan.dec_mask = (torch.arange(s_max)[None, :] < lens[:, None])[:, None, None, :].to(dev)
        plan.dec_tok = torch.tensor(dec_tok, dtype=torch.int64, device=dev)
    return plan


def _rows(table: list[int], n: int, bs: int, pad: bool = False) -> torch.Tensor:
    pos = torch.arange(n)
    blocks = torch.tensor(table + [0] * (-(-n // bs) - len(table)) if pad else table)
    return blocks.to(torch.int64)[pos // bs] * bs + pos % bs


def keqv_attention(
    plan: KEqVPlan,
    q: torch.Tensor,  # [T, H, D], normed and rotated
    k: torch.Tensor,  # [T, Hkv, D] this step's K (rope(w * v)), used when a chunk is its context
    v: torch.Tensor,  # [T, Hkv, D] this step's V = v_norm(p)
    cache: torch.Tensor,  # [num_blocks, 1, block_size, Hkv, D]: V only
    k_weight: torch.Tensor,  # [D] k_norm weight
    cos: torch.Tensor,  # [P, D] the layer type's RoPE tables (positions 0..P-1)
    sin: torch.Tensor,
    write: bool = True,  # False for a KV-shared layer: its source already wrote these rows
    invariant: bool = False,  # batch-invariant path (module doc)
) -> torch.Tensor:  # [T, H, D]
    hkv, d = cache.shape[-2], cache.shape[-1]
    flat = cache.view(-1, hkv, d)
    if write:
        flat.index_copy_(0, plan.slots, v)
    if invariant:
        return _invariant(plan, q, v, flat, k_weight, cos, sin)
    out = torch.empty_like(q)
    if plan.dec_tok is not None:
        assert plan.dec_rows is not None
        bd, s_max = plan.dec_rows.shape
        cv = flat.index_select(0, plan.dec_rows.reshape(-1)).view(bd, s_max, hkv, d)
        ck = _k_on_read(cv, k_weight, cos[:s_max], sin[:s_max])
        qg = q[plan.dec_tok].view(bd, hkv, -1, d)
        o = F.scaled_dot_product_attention(
            qg, ck.transpose(1, 2), cv.transpose(1, 2), attn_mask=plan.dec_mask, scale=1.0
        )
        out[plan.dec_tok] = o.reshape(bd, -1, d)
    for start, end, s, rows, mask in plan.prefills:
        if rows is None:
            ck, cv = k[start:end], v[start:end]  # [S, Hkv, D]
        else:
            cv = flat.index_select(0, rows)
            ck = _k_on_read(cv[None], k_weight, cos[:s], sin[:s])[0]
        qh = q[start:end].transpose(0, 1)[None]  # [1, H, Tq, D]
        o = F.scaled_dot_product_attention(
            qh,
            ck.transpose(0, 1)[None],
            cv.transpose(0, 1)[None],
            attn_mask=mask,
            scale=1.0,
            enable_gqa=True,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out


def _invariant(
    plan: KEqVPlan,
    q: torch.Tensor,  # [T, H, D]
    v: torch.Tensor,  # [T, Hkv, D] this step's V
    flat: torch.Tensor,  # [rows, Hkv, D] the V-only cache
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """Every sequence alone, K rebuilt from V in the cache dtype whether read or just written."""
    out = torch.empty_like(q)
    if plan.dec_tok is not None:
        assert plan.dec_rows is not None
        for j, (tok, n) in enumerate(zip(plan.dec_tok.tolist(), plan.dec_lens, strict=True)):
            cv = flat.index_select(0, plan.dec_rows[j, :n])  # [n, Hkv, D]
            ck = _k_on_read(cv[None], k_weight, cos[:n], sin[:n])[0]
            out[tok : tok + 1] = attend_sequence(q[tok : tok + 1], ck, cv, None, 1.0)
    for start, end, s, rows, _ in plan.prefills:
        cv = v[start:end].to(flat.dtype) if rows is None else flat.index_select(0, rows)
        ck = _k_on_read(cv[None], k_weight, cos[:s], sin[:s])[0]
        out[start:end] = attend_sequence(q[start:end], ck, cv, None, 1.0)
    return out


def _k_on_read(
    v: torch.Tensor, w: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor
) -> torch.Tensor:
    """v [B, S, Hkv, D] (position j at index j) -> K = rope(w * v): k_norm's scale, then RoPE."""
    k = (v.float() * w.float()).to(v.dtype)
    return apply_rope(k, cos[None, :, None, :], sin_signed[None, :, None, :])
