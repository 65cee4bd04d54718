"""KVSpec: the paged KV layout shared by every process that holds or moves KV. Torch-free.

Per layer the cache is one tensor `[num_blocks, 2, block_size, num_kv_heads, head_dim]`
(flashinfer NHD paged layout; index 0 of dim 1 is K, 1 is V). A block moved between processes
is all layers of that block: `[num_layers, 2, block_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pdserve.model.dtypes import ITEMSIZE as _ITEMSIZE

KV_LAYOUT = "NHD:[blocks,2,block_size,kv_heads,head_dim]"


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE:
            raise ValueError(f"dtype must be one of {sorted(_ITEMSIZE)}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of one block in one layer: (2, block_size, num_kv_heads, head_dim)."""
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_layer(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_block_layer

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def kv_fingerprint(self, model_fingerprint: str) -> str:
        """The kv_fingerprint: block hashes are chained from it and the kvstore keys blocks by
        it (its wire field `namespace`). Two processes share KV blocks only if
        their weights identity, dtype, block size and KV layout all match."""
        text = "|".join(
            [
                "pdserve-kv-v1",
                model_fingerprint,
                self.dtype,
                f"bs={self.block_size}",
                f"L={self.num_layers}",
                f"kvh={self.num_kv_heads}",
                f"hd={self.head_dim}",
                KV_LAYOUT,
            ]
        )
        return hashlib.blake2b(text.encode("utf-8"), digest_size=16).hexdigest()
