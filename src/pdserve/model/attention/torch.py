"""Torch attention backend: the CPU reference, written to be fast on CPU.

Per step (`prepare`) we turn the block tables into row indices of the flat cache view
`kv_cache.view(num_blocks * 2 * block_size, Hkv, D)`: the K row of slot (block b, offset o)
is `b * 2 * block_size + o` and its V row is that plus `block_size`. Every layer then
  - writes the new k/v with one `index_copy_` each (the kernel path: attend_paged writes them),
  - runs all decode sequences (query_len == 1) as ONE batched SDPA over their contexts
    gathered into `[Bd, Hkv, S_max, D]` with a length mask; the G = H / Hkv query heads of a
    kv head act as the query axis, so GQA needs no repeat of K/V,
  - runs each prefill chunk with one SDPA against its context (fresh k/v directly when the
    chunk is the whole context, else the gathered cache) under a causal-with-offset mask.

`batch_invariant` (the default) replaces the SDPA calls by an attention whose result for a
query does not depend on the batch, the chunking or decode-vs-prefill: the fused C++ kernel
(`fixed_kernel`: one call per layer for the whole step, reading the paged cache through the
block table), else `fixed.attend` in torch ops (the fallback, and quantized KV). The engine's
`KernelSelection` sets the choice once (`use_kernels`: the kernel and its ISA build, or not)
and it is kept; a backend nobody set resolves it at its first step from this process's
settings. The SDPA path stays as the batch-variant alternative (`--no-batch-invariant`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.kv.quant import QuantRows
from pdserve.model.attention import fixed, fixed_kernel
from pdserve.model.attention.base import AttentionBackend
from pdserve.model.attention.metadata import AttentionMetadata


@dataclass
class _Prefill:
    start: int  # first token index in the flattened batch
    end: int
    seq_len: int
    rows: torch.Tensor | None  # [S] K rows of the whole context; None when context == chunk
    masks: dict[int | None, torch.Tensor | None] = field(default_factory=dict)
    biases: dict[tuple[int, int | None], torch.Tensor] = field(default_factory=dict)  # fixed.*


@dataclass
class TorchPlan:
    k_rows: torch.Tensor  # [T] K row of each new token (V row = + block_size)
    block_size: int
    dec_tok: torch.Tensor | None  # [Bd] token index of each decode sequence
    dec_all: bool  # every token is a decode, in order: no gather/scatter of q needed
    dec_rows: torch.Tensor | None  # [Bd, S_max] K rows of decode contexts (pad -> row 0)
    dec_lens: torch.Tensor | None  # [Bd] context lengths
    v_rows: torch.Tensor | None = None  # [T] k_rows + block_size (once per step, not per layer)
    # [2 * Bd * S_max] K rows of the decode contexts, then their V rows: one gather per layer
    dec_kv_rows: torch.Tensor | None = None
    # per window: [Bd,1,1,S_max] bool (SDPA), or fixed.tile_bias [Bd,1,nt,1,1,T] (invariant)
    dec_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    prefills: list[_Prefill] = field(default_factory=list)


def _rows(table: list[int], n: int, bs: int) -> torch.Tensor:
    pos = torch.arange(n)
    blocks = torch.tensor(table, dtype=torch.int64)[pos // bs]
    return blocks * (2 * bs) + pos % bs


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    # the fused kernel (fixed_kernel) when invariant, on CPU: set by `use_kernels` (the
    # engine's KernelSelection), else resolved at the first step from the process settings
    use_kernel: bool | None = None
    kernel_variant: str | None = None  # its ISA build (None: fixed_kernel.served_variant())

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.batch_invariant = True  # set by the runner (EngineConfig.batch_invariant)
        self._ext: Any = None  # the kernel's module, once use_kernel is resolved

    def use_kernels(self, selection: Any) -> None:
        """Take the attention of a `pdserve.model.kernels.KernelSelection`, for life."""
        self.use_kernel = selection.attention == "kernel"
        self.kernel_variant = selection.isa or None
        self._ext = None

    def kernel_module(self) -> Any:
        """The attention kernel's module this backend runs (use_kernel must be True)."""
        if self._ext is None:
            self._ext = fixed_kernel.load(self.kernel_variant)
            if self._ext is None:
                why = fixed_kernel.KERNEL.why_unavailable(self.kernel_variant)
                raise RuntimeError(f"the attention kernel was chosen but {why}")
        return self._ext

    def prepare(self, meta: AttentionMetadata) -> TorchPlan | fixed_kernel.KernelPlan:
        if self.batch_invariant:
            if self.use_kernel is None:
                self.use_kernel = fixed_kernel.available(self.kernel_variant)
            if self.use_kernel and meta.slot_mapping.device.type == "cpu":
                return fixed_kernel.plan(meta)
        return self._prepare_torch(meta)

    def _prepare_torch(self, meta: AttentionMetadata) -> TorchPlan:
        bs = meta.block_size
        device = meta.slot_mapping.device
        k_rows = meta.k_rows()
        dec_idx, dec_tok, prefills = [], [], []
        start = 0
        for i, (q, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
            if q == 1:
                dec_idx.append(i)
                dec_tok.append(start)
            else:
                rows = None if q == s else _rows(meta.block_tables_cpu[i], s, bs).to(device)
                prefills.append(_Prefill(start, start + q, s, rows))
            start += q
        plan = TorchPlan(k_rows, bs, None, False, None, None, k_rows + bs, prefills=prefills)
        if dec_idx:
            lens = [meta.seq_lens_cpu[i] for i in dec_idx]
            s_max = max(lens)
            if self.batch_invariant:  # whole key tiles; padding rows are masked
                s_max = fixed.padded_len(s_max)
            n_blk = -(-s_max // bs)
            table = torch.zeros(len(dec_idx), n_blk, dtype=torch.int64)
            for r, i in enumerate(dec_idx):
                t = meta.block_tables_cpu[i][:n_blk]
                table[r, : len(t)] = torch.tensor(t, dtype=torch.int64)
            pos = torch.arange(s_max)
            plan.dec_rows = (table[:, pos // bs] * (2 * bs) + pos % bs).to(device)
            flat_rows = plan.dec_rows.reshape(-1)
            plan.dec_kv_rows = torch.cat([flat_rows, flat_rows + bs])
            plan.dec_lens = torch.tensor(lens, dtype=torch.int64, device=device)
            plan.dec_all = not prefills
            plan.dec_tok = torch.tensor(dec_tok, dtype=torch.int64, device=device)
        return plan

    def forward(
        self,
        plan: TorchPlan | fixed_kernel.KernelPlan,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        window: int | None,
    ) -> torch.Tensor:
        hkv, d = self.num_kv_heads, self.head_dim
        if isinstance(plan, fixed_kernel.KernelPlan):
            if kv_cache.dim() == 5:  # the fused kernel writes k / v and reads the paged cache
                a = (plan.tables, plan.tok_seq, plan.tok_pos, plan.ctx_lens, window, self.scale)
                return fixed_kernel.attend_paged(
                    q, kv_cache, *a, k=k, v=v, k_rows=plan.k_rows, ext=self.kernel_module()
                )
            if plan.torch_plan is None:  # quantized KV: the torch fixed path, for life
                plan.torch_plan = self._prepare_torch(plan.meta)
            plan = plan.torch_plan
        if kv_cache.dim() == 2:  # quantized KV (pdserve.kv.quant): same row API, dequantized
            flat = QuantRows(kv_cache, plan.block_size, hkv, d, q.dtype)
        else:
            flat = kv_cache.view(-1, hkv, d)  # [num_blocks * 2 * bs, Hkv, D]
        flat.index_copy_(0, plan.k_rows, k)
        flat.index_copy_(0, plan.v_rows, v)
        if plan.dec_all:
            return self._decode(plan, q, flat, window)
        out = torch.empty_like(q)
        if plan.dec_tok is not None:
            out[plan.dec_tok] = self._decode(plan, q[plan.dec_tok], flat, window)
        for p in plan.prefills:
            out[p.start : p.end] = self._prefill(
                p, q[p.start : p.end], k, v, flat, plan.block_size, window
            )
        return out

    def _decode(
        self, plan: TorchPlan, q: torch.Tensor, flat: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        # q: [Bd, H, D] -> [Bd, Hkv, G, D]; context k/v: [Bd, Hkv, S_max, D] (strided views)
        bd = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        assert plan.dec_rows is not None and plan.dec_lens is not None
        if self.batch_invariant:
            return self._decode_fixed(plan, q, flat, window)
        mask = plan.dec_masks.get(window)
        if mask is None:
            j = torch.arange(plan.dec_rows.shape[1], device=q.device)
            lens = plan.dec_lens[:, None]
            m = j[None, :] < lens
            if window is not None:
                m &= j[None, :] > lens - 1 - window
            mask = plan.dec_masks[window] = m[:, None, None, :]
        # index_select (row memcpy) is ~8x faster than advanced indexing here; K and V rows
        # in one gather (fewer ops per layer: at decode batch sizes op overhead shows)
        s_max = plan.dec_rows.shape[1]
        ckv = flat.index_select(0, plan.dec_kv_rows).view(2, bd, s_max, hkv, d)
        ck, cv = ckv[0].transpose(1, 2), ckv[1].transpose(1, 2)
        qg = q.view(bd, hkv, -1, d)
        o = F.scaled_dot_product_attention(qg, ck, cv, attn_mask=mask, scale=self.scale)
        return o.reshape(bd, -1, d)  # [Bd, H, D]

    def _decode_fixed(
        self, plan: TorchPlan, q: torch.Tensor, flat: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        bd = q.shape[0]
        hkv, d = self.num_kv_heads, self.head_dim
        assert plan.dec_rows is not None and plan.dec_lens is not None
        s = plan.dec_rows.shape[1]
        bias = plan.dec_masks.get(window)
        if bias is None:  # [Bd, 1, nt, 1, 1, T]
            pos = (plan.dec_lens - 1)[:, None]
            bias = plan.dec_masks[window] = fixed.tile_bias(pos, s, plan.dec_lens, window)
        ckv = flat.index_select(0, plan.dec_kv_rows).view(2, bd, s, hkv, d)
        # one copy: [2, Bd, Hkv, S, D] float32 (attend's layout)
        ckv = ckv.permute(0, 1, 3, 2, 4).to(torch.float32, memory_format=torch.contiguous_format)
        o = fixed.attend(q.view(bd, hkv, 1, -1, d), ckv[0], ckv[1], bias, self.scale)
        return o.reshape(bd, -1, d).to(q.dtype)  # [Bd, H, D]

    def _prefill(
        self,
        p: _Prefill,
        q: torch.Tensor,  # [Tq, H, D]
        k: torch.Tensor,  # [T, Hkv, D] (whole step)
        v: torch.Tensor,
        flat: torch.Tensor,
        bs: int,
        window: int | None,
    ) -> torch.Tensor:
        tq = q.shape[0]
        if self.batch_invariant:
            if p.rows is None:  # [S, Hkv, D]: the fresh k/v are the cached values
                ck, cv = k[p.start : p.end], v[p.start : p.end]
            else:
                ck, cv = flat.index_select(0, p.rows), flat.index_select(0, p.rows + bs)
            return fixed.attend_sequence(q, ck, cv, window, self.scale, p.biases)
        if p.rows is None:  # the chunk is the whole context: use fresh k/v
            ck = k[p.start : p.end].transpose(0, 1)  # [Hkv, S, D]
            cv = v[p.start : p.end].transpose(0, 1)
        else:
            ck = flat.index_select(0, p.rows).transpose(0, 1)
            cv = flat.index_select(0, p.rows + bs).transpose(0, 1)
        # q: [Tq, H, D] -> [1, H, Tq, D]; enable_gqa maps query head h to kv head h // G
        # without copying K/V (3-4x faster on CPU than broadcasting a group axis)
        qh = q.transpose(0, 1)[None]
        if p.rows is None and window is None:  # plain causal: no mask to build
            o = F.scaled_dot_product_attention(
                qh, ck[None], cv[None], is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            if window not in p.masks:
                p.masks[window] = _causal_mask(tq, p.seq_len, window, q.device)
            o = F.scaled_dot_product_attention(
                qh,
                ck[None],
                cv[None],
                attn_mask=p.masks[window],
                scale=self.scale,
                enable_gqa=True,
            )
        return o[0].transpose(0, 1)  # [Tq, H, D]


def _causal_mask(tq: int, s: int, window: int | None, device: torch.device) -> torch.Tensor:
    """[Tq, S] bool, True = visible. Query i sits at position s - tq + i."""
    qpos = torch.arange(s - tq, s, device=device)[:, None]
    kpos = torch.arange(s, device=device)[None, :]
    m = kpos <= qpos
    if window is not None:
        m &= kpos > qpos - window
    return m
