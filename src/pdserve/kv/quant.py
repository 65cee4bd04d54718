"""Quantized KV: int8 or fp8 (e4m3) elements with one float32 scale per (block, K/V, kv head).

A quantized layer cache is ONE raw tensor per layer, `[num_blocks, row_bytes]`, each row a
whole block: the elements `[2, block_size, Hkv, D]` (1 byte each), then the scales `[2, Hkv]`
(float32). Keeping a block's scales inside its row means every block-granular path (the
transfer's `read_layer` / `write_layer`, the kvstore's blocks, prefix caching) moves scales
with their data for free, and the bytes per block are `2*bs*Hkv*D + 8*Hkv` — for bs = 16 and
D = 64 that is 0.504x bf16 (0.252x fp32).

The raw tensor's dtype names the element type: int8 -> int8 KV (symmetric, [-127, 127]),
uint8 -> fp8 e4m3 bytes (torch.float8_e4m3fn, max 448; CPU indexing kernels lack float8, so
the bytes are indexed as uint8 and reinterpreted only to cast).

Writes (`QuantRows.index_copy_`, the paged cache's write of a step's k or v): a block's scale
is the running amax/QMAX of what it holds. A write at offset 0 starts the block afresh (blocks
fill in order, so offset 0 means a new owner); when a new token's amax exceeds the scale, the
block's earlier tokens are re-quantized to the larger scale (one extra rounding each time).
Reads (`index_select`) dequantize to float32; the attention backend casts to its dtype.

Batch invariance: NOT in general. A block's bytes depend on how its tokens were grouped
into writes: written in one step (a prefill chunk covering the block) each element is rounded
once against the block's final scale; written in two steps (a chunk boundary inside the
block, which the scheduler's shared token budget decides) the earlier tokens are rounded
again when the scale grows (tests/unit/test_kv_quant.py shows 16 tokens as 16 vs 8 + 8
differ). For one grouping the bytes are deterministic, and decode (one token per step) and
prefix blocks imported whole do not depend on the batch. Making it invariant would need the
open block kept in full precision and quantized once when it fills (not done).
"""

from __future__ import annotations

import torch

from pdserve.kv.spec import QUANT_KV_DTYPES as KV_QUANT_DTYPES
from pdserve.kv.spec import SCALE_BYTES  # float32

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
RAW_DTYPE = {"int8": torch.int8, "fp8_e4m3": torch.uint8}
_MIN_SCALE = 1e-12


def is_quantized(kv_dtype: str) -> bool:
    return kv_dtype in KV_QUANT_DTYPES


def kind_of(raw: torch.Tensor) -> str:
    return "int8" if raw.dtype == torch.int8 else "fp8_e4m3"


def row_bytes(block_size: int, num_kv_heads: int, head_dim: int) -> int:
    """Bytes of one block of one layer: elements + scales."""
    return 2 * block_size * num_kv_heads * head_dim + 2 * num_kv_heads * SCALE_BYTES


def allocate(
    kv_dtype: str, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
    device: torch.device | str = "cpu",
) -> torch.Tensor:  # fmt: skip
    """A zeroed raw layer cache `[num_blocks, row_bytes]`."""
    if not is_quantized(kv_dtype):
        raise ValueError(f"{kv_dtype!r} is not a quantized KV dtype ({KV_QUANT_DTYPES})")
    n = row_bytes(block_size, num_kv_heads, head_dim)
    return torch.zeros(num_blocks, n, dtype=RAW_DTYPE[kv_dtype], device=device)


def views(
    raw: torch.Tensor, block_size: int, hkv: int, d: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements `[nb, 2, bs, Hkv, D]` in the raw dtype, scales `[nb, 2, Hkv]` float32)."""
    nb = raw.shape[0]
    n = 2 * block_size * hkv * d
    data = raw[:, :n].view(nb, 2, block_size, hkv, d)
    scales = raw[:, n:].view(torch.float32).view(nb, 2, hkv)
    return data, scales


def quantize(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """x / scale (scale broadcast over x's last dim) in the raw dtype of `kind`."""
    y = (x.float() / scale.unsqueeze(-1)).clamp_(-QMAX[kind], QMAX[kind])
    if kind == "int8":
        return y.round_().to(torch.int8)
    return y.to(torch.float8_e4m3fn).view(torch.uint8)


def dequantize(q: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 of raw elements `q` times `scale` (broadcast over the last dim)."""
    x = q.float() if kind == "int8" else q.view(torch.float8_e4m3fn).float()
    return x * scale.unsqueeze(-1)


def quantize_blocks(kv: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    """Full-precision blocks `[n, 2, bs, Hkv, D]` -> raw rows `[n, row_bytes]` (a scale per
    (block, K/V, head) = its amax / QMAX): for converting KV between pools of two dtypes."""
    n, _, bs, hkv, d = kv.shape
    raw = allocate(kv_dtype, n, bs, hkv, d, kv.device)
    data, scales = views(raw, bs, hkv, d)
    amax = kv.float().abs().amax(dim=(2, 4))  # [n, 2, Hkv]
    scales.copy_((amax / QMAX[kv_dtype]).clamp_min(_MIN_SCALE))
    # [n, 2, bs, Hkv, D] / [n, 2, 1, Hkv, 1]
    data.copy_(quantize(kv, scales[:, :, None, :], kv_dtype))
    return raw


def dequantize_blocks(raw: torch.Tensor, bs: int, hkv: int, d: int) -> torch.Tensor:
    """Raw rows -> float32 blocks `[n, 2, bs, Hkv, D]`."""
    data, scales = views(raw, bs, hkv, d)
    return dequantize(data, scales[:, :, None, :], kind_of(raw))


class QuantRows:
    """The flat-row view of a quantized layer cache that the torch attention backend uses in
    place of `kv_cache.view(-1, Hkv, D)`: row `b * 2 * bs + kv * bs + o` is token slot o of
    block b, K (kv = 0) or V (kv = 1)."""

    def __init__(
        self, raw: torch.Tensor, block_size: int, hkv: int, d: int, dtype: torch.dtype
    ) -> None:
        self.kind = kind_of(raw)
        self.dtype = dtype  # what index_select returns (the attention's compute dtype)
        self.bs = block_size
        self.data, self.scales = views(raw, block_size, hkv, d)

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        two_bs = 2 * self.bs
        r = rows % two_bs
        return rows // two_bs, r // self.bs, r % self.bs  # block, K/V, offset

    def index_copy_(self, dim: int, rows: torch.Tensor, x: torch.Tensor) -> None:
        """Quantize x `[T, Hkv, D]` into `rows` (one step's K or V), growing block scales."""
        assert dim == 0
        if rows.numel() == 0:
            return
        blk, kv, off = self._split(rows)
        touched, inv = torch.unique(blk * 2 + kv, return_inverse=True)
        tb, tk = touched // 2, touched % 2
        old = self.scales[tb, tk]  # [n, Hkv]
        fresh = torch.zeros(len(touched), dtype=torch.bool, device=rows.device)
        fresh[inv[off == 0]] = True  # a block written from offset 0 starts afresh
        old = torch.where(fresh[:, None], torch.zeros_like(old), old)
        amax = x.float().abs().amax(-1) / QMAX[self.kind]  # [T, Hkv]
        idx = inv[:, None].expand_as(amax)
        need = torch.zeros_like(old).scatter_reduce_(0, idx, amax, "amax")
        new = torch.maximum(old, need).clamp_min_(_MIN_SCALE)
        grow = ((new > old) & (old > 0)).any(-1)  # blocks with earlier tokens to re-scale
        if bool(grow.any()):
            gb, gk = tb[grow], tk[grow]
            prev = self.data[gb, gk]  # [g, bs, Hkv, D]
            deq = dequantize(prev, old[grow][:, None, :], self.kind)
            self.data[gb, gk] = quantize(deq, new[grow][:, None, :], self.kind)
        self.scales[tb, tk] = new
        self.data[blk, kv, off] = quantize(x, new[inv], self.kind)

    def index_select(self, dim: int, rows: torch.Tensor) -> torch.Tensor:
        """Dequantized rows `[N, Hkv, D]` in `self.dtype`."""
        assert dim == 0
        blk, kv, off = self._split(rows)
        x = dequantize(self.data[blk, kv, off], self.scales[blk, kv], self.kind)
        return x.to(self.dtype)
