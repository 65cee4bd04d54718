"""Batch-invariant attention: a query's output does not depend on what else is computed with it.

`F.scaled_dot_product_attention` on CPU is not batch-invariant (measured, torch 2.13; the
probe is `tests/unit/test_batch_invariant_ops.py`): its flash kernel picks the KV split from
the key length, so a decode row padded to a longer batch neighbour's context, a prompt
chunked differently, or the same token attended as a decode instead of inside a prefill gives
different bits, in fp32 and bf16 alike.

`attend` fixes every reduction order, whatever the batch:
  - math in float32 (a bf16 cache is upcast; scores and probabilities stay fp32);
  - scores = q @ k^T by a float32 batched GEMM whose reduction axis is head_dim (fixed). The
    GEMM's per-element result depends on the row count only below MIN_ROWS rows (MKL takes
    another kernel for 1-3 rows), so query rows are padded to at least MIN_ROWS;
  - keys are laid out in tiles of KV_TILE positions counted from position 0 of the sequence,
    padded with masked keys. Padding only ever adds whole tiles or masked slots whose
    probability is exactly 0, and adding an exact 0 changes no sum;
  - the softmax max is exact; the normaliser sums each tile (fixed length), then adds the tile
    sums in order (cumsum, sequential); the P @ V product is one GEMM per tile (reduction
    length KV_TILE) whose partial outputs are added in tile order the same way.
Query rows are independent, so long prefills are cut into row blocks (Q_BLOCK tokens) without
changing any result, and each block only reads the key tiles its causal horizon reaches.
"""

from __future__ import annotations

import torch

KV_TILE = 64  # keys per reduction tile (>= 16: MKL's GEMM result is column-count invariant)
MIN_ROWS = 4  # MKL's float32 GEMM takes another kernel below 4 rows
Q_BLOCK = 256  # query tokens per block of a long prefill (bounds the [rows, S] score memory)


def padded_len(n: int) -> int:
    """n rounded up to a whole number of key tiles."""
    return -(-n // KV_TILE) * KV_TILE


def attend(
    q: torch.Tensor,  # [B, Hkv, Tq, G, D] (G query heads per kv head)
    k: torch.Tensor,  # [B, Hkv, S, D], S % KV_TILE == 0 (any strides)
    v: torch.Tensor,  # [B, Hkv, S, D]
    visible: torch.Tensor,  # bool, broadcastable to [B, 1, Tq, 1, S]; True = attend
    scale: float,
) -> torch.Tensor:  # [B, Hkv, Tq, G, D] float32
    b, hkv, tq, g, d = q.shape
    s = k.shape[2]
    assert s % KV_TILE == 0, "pad keys to whole tiles (padded_len)"
    nt = s // KV_TILE
    m = tq * g
    f32 = torch.float32
    qf = (q.to(f32) * scale).reshape(b, hkv, m, d)
    if m < MIN_ROWS:  # same GEMM kernel as for many rows
        qf = torch.cat([qf, qf.new_zeros(b, hkv, MIN_ROWS - m, d)], 2)
    kf = k.to(f32, memory_format=torch.contiguous_format)
    vf = v.to(f32, memory_format=torch.contiguous_format)
    scores = torch.matmul(qf, kf.transpose(-1, -2))[:, :, :m]  # [B, Hkv, M, S]
    scores = scores.view(b, hkv, tq, g, s).masked_fill(~visible, float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True)).view(b, hkv, m, nt, KV_TILE)
    denom = p.sum(-1).cumsum(-1)[..., -1:]  # [B, Hkv, M, 1]: tile sums added in order
    pt = p.transpose(2, 3)  # [B, Hkv, nt, M, T]
    if m < MIN_ROWS:
        pt = torch.cat([pt, pt.new_zeros(b, hkv, nt, MIN_ROWS - m, KV_TILE)], 3)
    part = torch.matmul(pt, vf.view(b, hkv, nt, KV_TILE, d))[:, :, :, :m]  # [B, Hkv, nt, M, D]
    out = part.cumsum(2)[:, :, -1] / denom  # tile partials added in order
    return out.view(b, hkv, tq, g, d)


def causal_visible(
    q_pos: torch.Tensor,  # [Tq] int64 absolute positions of the queries
    s: int,  # padded key length
    ctx_len: int,  # real keys (positions 0 .. ctx_len - 1)
    window: int | None,
) -> torch.Tensor:  # [1, 1, Tq, 1, S] bool
    kpos = torch.arange(s, device=q_pos.device)[None, :]
    qp = q_pos[:, None]
    m = (kpos <= qp) & (kpos < ctx_len)
    if window is not None:
        m &= kpos > qp - window
    return m[None, None, :, None, :]


def attend_sequence(
    q: torch.Tensor,  # [Tq, H, D], queries at positions ctx_len - Tq .. ctx_len - 1
    k: torch.Tensor,  # [ctx_len, Hkv, D] the whole context, this step's keys included
    v: torch.Tensor,
    window: int | None,
    scale: float,
) -> torch.Tensor:  # [Tq, H, D] in q's dtype
    tq, h, d = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    g = h // hkv
    out = torch.empty_like(q)
    first = ctx - tq
    for a in range(0, tq, Q_BLOCK):
        e = min(tq, a + Q_BLOCK)
        horizon = first + e  # keys this block can see: 0 .. horizon - 1
        s = padded_len(horizon)
        kb, vb = _pad_keys(k[:horizon], s), _pad_keys(v[:horizon], s)
        qb = q[a:e].view(e - a, hkv, g, d).transpose(0, 1)[None]  # [1, Hkv, Tb, G, D]
        pos = torch.arange(first + a, first + e, device=q.device)
        vis = causal_visible(pos, s, horizon, window)
        o = attend(qb, kb.transpose(0, 1)[None], vb.transpose(0, 1)[None], vis, scale)
        out[a:e] = o[0].transpose(0, 1).reshape(e - a, h, d).to(q.dtype)
    return out


def _pad_keys(x: torch.Tensor, s: int) -> torch.Tensor:
    """[n, Hkv, D] -> [s, Hkv, D] with zero rows appended (masked, so never weighted)."""
    n = x.shape[0]
    if n == s:
        return x
    return torch.cat([x, x.new_zeros(s - n, *x.shape[1:])])
