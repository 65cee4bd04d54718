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
    another kernel for 1-3 rows), so query rows are padded to at least MIN_ROWS; it does not
    depend on the key count (measured for padded key counts from 64 to 4096);
  - keys are laid out in tiles of KV_TILE positions counted from position 0 of the sequence,
    padded with masked keys. Padding only ever adds whole tiles or masked slots whose
    probability is exactly 0, and adding an exact 0 changes no sum;
  - masking adds a 0 / -inf bias; the softmax max is exact; the normaliser sums each tile
    (fixed length), then adds the tile sums in order (cumsum, sequential); P @ V is one GEMM
    per tile (reduction length KV_TILE: MKL's result for a longer reduction changes with its
    length, zeros or not) whose partial outputs are added in tile order the same way.
These properties are measured, not promised by MKL / oneDNN: tests/unit/test_batch_invariant_ops.py
checks them on the machine that runs the suite (another BLAS or torch build may differ).
Padding keys of a decode batch are read from cache row 0 (finite values: the cache is zeroed at
allocation and only ever holds computed K/V), so their exactly-0 weights contribute exact zeros.
Query rows are independent, so long prefills are cut into row blocks (Q_BLOCK tokens) without
changing any result, and each block only reads the key tiles its causal horizon reaches.
"""

from __future__ import annotations

import torch

KV_TILE = 64  # keys per reduction tile of the P @ V GEMM and of the softmax normaliser
MIN_ROWS = 4  # MKL's float32 GEMM takes another kernel below 4 rows
Q_BLOCK = 256  # query tokens per block of a long prefill (bounds the [rows, S] score memory)


def padded_len(n: int) -> int:
    """n rounded up to a whole number of key tiles."""
    return -(-n // KV_TILE) * KV_TILE


def attend(
    q: torch.Tensor,  # [B, Hkv, Tq, G, D] (G query heads per kv head)
    k: torch.Tensor,  # [B, Hkv, S, D], S % KV_TILE == 0 (any strides and float dtype)
    v: torch.Tensor,  # [B, Hkv, S, D]
    bias: torch.Tensor,  # float32 0 / -inf, broadcastable to [B, 1, Tq, 1, S]
    scale: float,
) -> torch.Tensor:  # [B, Hkv, Tq, G, D] float32
    b, hkv, tq, g, d = q.shape
    s = k.shape[2]
    assert s % KV_TILE == 0, "pad keys to whole tiles (padded_len)"
    nt, m, f32 = s // KV_TILE, tq * g, torch.float32
    qf = q.reshape(b, hkv, m, d).to(f32) * scale
    if m < MIN_ROWS:  # the GEMM kernel of many rows, for few rows too
        qf = torch.cat([qf, qf.new_zeros(b, hkv, MIN_ROWS - m, d)], 2)
    kf = k.to(f32, memory_format=torch.contiguous_format)
    vf = v.to(f32, memory_format=torch.contiguous_format)
    scores = torch.matmul(qf, kf.transpose(-1, -2))  # [B, Hkv, M, S]; reduction over D only
    if m < MIN_ROWS:
        scores = scores[:, :, :m]
    scores = scores.reshape(b, hkv, tq, g, s) + bias
    p = torch.exp(scores - scores.amax(-1, keepdim=True))  # exact max, exact exps
    tile_sums = p.view(b, hkv, m, nt, KV_TILE).sum(-1)  # [B, Hkv, M, nt]
    # one tile: no adds across tiles (and + 0.0 from padding tiles would change nothing)
    denom = tile_sums[..., :1] if nt == 1 else tile_sums.cumsum(-1)[..., -1:]
    pt = p.view(b, hkv, m, nt, KV_TILE).transpose(2, 3)  # [B, Hkv, nt, M, T]
    if m < MIN_ROWS:
        pt = torch.cat([pt, pt.new_zeros(b, hkv, nt, MIN_ROWS - m, KV_TILE)], 3)
    part = torch.matmul(pt, vf.view(b, hkv, nt, KV_TILE, d))  # [B, Hkv, nt, M4, D]
    out = part[:, :, 0] if nt == 1 else part.cumsum(2)[:, :, -1]  # tiles added in order
    if m < MIN_ROWS:
        out = out[:, :, :m]
    return (out / denom).view(b, hkv, tq, g, d)


def tile_bias(
    q_pos: torch.Tensor,  # [Tq] (or [B, Tq]) int64 absolute positions of the queries
    s: int,  # padded key length (whole tiles)
    ctx_len: torch.Tensor | int,  # real keys: 0 .. ctx_len - 1 (int, or [B] per row)
    window: int | None,
) -> torch.Tensor:  # [B or 1, 1, Tq, 1, S] float32: 0 visible, -inf masked
    qp = q_pos if q_pos.dim() == 2 else q_pos[None]  # [B, Tq]
    kpos = torch.arange(s, device=qp.device)
    ctx = torch.as_tensor(ctx_len, device=qp.device).reshape(-1, 1, 1)
    m = (kpos <= qp[..., None]) & (kpos < ctx)  # [B, Tq, S]
    if window is not None:
        m &= kpos > qp[..., None] - window
    bias = torch.zeros(m.shape, device=qp.device).masked_fill_(~m, float("-inf"))
    return bias[:, None, :, None, :]


def attend_sequence(
    q: torch.Tensor,  # [Tq, H, D], queries at positions ctx_len - Tq .. ctx_len - 1
    k: torch.Tensor,  # [ctx_len, Hkv, D] the whole context, this step's keys included
    v: torch.Tensor,
    window: int | None,
    scale: float,
    biases: dict | None = None,  # cache of tile_bias per (query block, window), per step
) -> torch.Tensor:  # [Tq, H, D] in q's dtype
    tq, h, d = q.shape
    ctx, hkv = k.shape[0], k.shape[1]
    g = h // hkv
    out = torch.empty_like(q)
    first = ctx - tq
    biases = {} if biases is None else biases
    for a in range(0, tq, Q_BLOCK):
        e = min(tq, a + Q_BLOCK)
        horizon = first + e  # keys this block can see: 0 .. horizon - 1
        s = padded_len(horizon)
        bias = biases.get((a, window))
        if bias is None:
            pos = torch.arange(first + a, first + e, device=q.device)
            bias = biases[(a, window)] = tile_bias(pos, s, horizon, window)
        kb, vb = _pad_keys(k[:horizon], s), _pad_keys(v[:horizon], s)  # [Hkv, S, D] fp32
        qb = q[a:e].view(e - a, hkv, g, d).transpose(0, 1)[None]  # [1, Hkv, Tb, G, D]
        o = attend(qb, kb[None], vb[None], bias, scale)
        out[a:e] = o[0].transpose(0, 1).reshape(e - a, h, d).to(q.dtype)
    return out


def _pad_keys(x: torch.Tensor, s: int) -> torch.Tensor:
    """[n, Hkv, D] -> [Hkv, s, D] float32, zero rows appended (masked, so never weighted)."""
    n, hkv, d = x.shape
    out = torch.zeros(hkv, s, d, device=x.device)
    out[:, :n] = x.transpose(0, 1)
    return out
