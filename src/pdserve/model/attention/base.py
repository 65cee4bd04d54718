"""The attention backend contract shared by the torch (CPU reference) and flashinfer backends."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from pdserve.model.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over per-layer caches `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
    (index 0 = K, 1 = V; flashinfer's NHD layout).

    Contract: `prepare(meta)` runs once per model step and returns an opaque plan; then for
    each layer `forward(plan, ...)` first writes the step's k/v into the cache at
    `meta.slot_mapping`, then returns causal attention of every new token against its
    sequence's whole context (cached prefix + this step's tokens), honouring a sliding
    window where given (key j is visible from query position p iff p - window < j <= p).
    Query head h reads kv head h // (num_heads // num_kv_heads) (GQA/MQA)."""

    name: str = "base"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        if num_heads % num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-step plan: index tensors, masks, wrapper plans. Called once per forward."""

    @abstractmethod
    def forward(
        self,
        plan: Any,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        window: int | None,
    ) -> torch.Tensor:  # [T, H, D]
        """Write k/v into kv_cache, then attend."""
