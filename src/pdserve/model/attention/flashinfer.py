"""flashinfer attention backend (CUDA only).

UNTESTED: written from the flashinfer documentation without a GPU to run it on. The torch
backend is the reference; run tests/unit/test_model_vs_transformers.py with
device="cuda" before relying on this one.

Uses the paged NHD layout our caches already have ([num_blocks, 2, block_size, Hkv, D] is
flashinfer's single-tensor NHD paged cache). Per step `prepare` turns the metadata into
flashinfer's CSR page table (indptr / indices / last_page_len); wrappers are planned lazily
per (kind, window_left) on the first layer that needs them and reused by every later layer
of the step. Steps where every sequence decodes one token use
BatchDecodeWithPagedKVCacheWrapper (tensor-core path: any GQA group size); any other step
uses BatchPrefillWithPagedKVCacheWrapper with a causal mask, which flashinfer aligns to the
end of each sequence's KV (so chunks after cached context work).
Window: our window W (key visible iff q_pos - k_pos < W) is flashinfer's window_left = W - 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from pdserve.model.attention.base import AttentionBackend
from pdserve.model.attention.metadata import AttentionMetadata

WORKSPACE_BYTES = 128 << 20


@dataclass
class FlashInferPlan:
    k_rows: torch.Tensor  # [T] K row of each new token in kv_cache.view(-1, Hkv, D)
    block_size: int
    decode_only: bool
    qo_indptr: torch.Tensor  # [B+1] int32
    kv_indptr: torch.Tensor  # [B+1] int32, into kv_indices
    kv_indices: torch.Tensor  # [sum pages] int32
    kv_last_page_len: torch.Tensor  # [B] int32 in 1..block_size
    planned: dict[tuple[int, torch.dtype], Any] = field(default_factory=dict)


class FlashInferBackend(AttentionBackend):
    name = "flashinfer"

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, device: torch.device | str
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError("FlashInferBackend needs a cuda device")
        import flashinfer  # only here, only on cuda

        self._fi = flashinfer
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self._wrappers: dict[tuple[str, int], Any] = {}

    def _wrapper(self, kind: str, window_left: int) -> Any:
        key = (kind, window_left)
        if key not in self._wrappers:
            if kind == "decode":
                self._wrappers[key] = self._fi.BatchDecodeWithPagedKVCacheWrapper(
                    self._workspace, "NHD", use_tensor_cores=True
                )
            else:
                self._wrappers[key] = self._fi.BatchPrefillWithPagedKVCacheWrapper(
                    self._workspace, "NHD"
                )
        return self._wrappers[key]

    def prepare(self, meta: AttentionMetadata) -> FlashInferPlan:
        bs = meta.block_size
        indptr, indices, last = [0], [], []
        for s, table in zip(meta.seq_lens_cpu, meta.block_tables_cpu, strict=True):
            n = -(-s // bs)
            indices.extend(table[:n])
            indptr.append(indptr[-1] + n)
            last.append(s - (n - 1) * bs)

        def dev(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int32, device=self.device)

        return FlashInferPlan(
            k_rows=meta.k_rows(),
            block_size=bs,
            decode_only=all(q == 1 for q in meta.query_lens_cpu),
            qo_indptr=meta.query_start_loc.to(device=self.device, dtype=torch.int32),
            kv_indptr=dev(indptr),
            kv_indices=dev(indices),
            kv_last_page_len=dev(last),
        )

    def _planned(self, plan: FlashInferPlan, window_left: int, dtype: torch.dtype) -> Any:
        key = (window_left, dtype)
        if key in plan.planned:
            return plan.planned[key]
        common = dict(
            window_left=window_left, sm_scale=self.scale, q_data_type=dtype, kv_data_type=dtype
        )
        if plan.decode_only:
            w = self._wrapper("decode", window_left)
            w.plan(
                plan.kv_indptr,
                plan.kv_indices,
                plan.kv_last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                plan.block_size,
                pos_encoding_mode="NONE",
                **common,
            )
        else:
            w = self._wrapper("prefill", window_left)
            w.plan(
                plan.qo_indptr,
                plan.kv_indptr,
                plan.kv_indices,
                plan.kv_last_page_len,
                self.num_heads,
                self.num_kv_heads,
                self.head_dim,
                plan.block_size,
                causal=True,
                pos_encoding_mode="NONE",
                **common,
            )
        plan.planned[key] = w
        return w

    def forward(
        self,
        plan: FlashInferPlan,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        window: int | None,
    ) -> torch.Tensor:
        flat = kv_cache.view(-1, self.num_kv_heads, self.head_dim)
        flat.index_copy_(0, plan.k_rows, k)
        flat.index_copy_(0, plan.k_rows + plan.block_size, v)
        wrapper = self._planned(plan, -1 if window is None else window - 1, q.dtype)
        return wrapper.run(q.contiguous(), kv_cache)  # [T, H, D]
