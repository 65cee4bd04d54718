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
# quantized KV (pdserve.kv.quant): a block of a layer is one row of elements + per-head scales
QUANT_KV_DTYPES = ("int8", "fp8_e4m3")
SCALE_BYTES = 4


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the KV dtype: "float32" | "bfloat16" | "float16" | "int8" | "fp8_e4m3"

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE and self.dtype not in QUANT_KV_DTYPES:
            names = sorted(_ITEMSIZE) + list(QUANT_KV_DTYPES)
            raise ValueError(f"dtype must be one of {names}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANT_KV_DTYPES

    @property
    def itemsize(self) -> int:
        return 1 if self.quantized else _ITEMSIZE[self.dtype]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block in one layer: (2, block_size, num_kv_heads, head_dim); for a
        quantized dtype one raw row of bytes: (bytes_per_block_layer,) (pdserve.kv.quant)."""
        if self.quantized:
            return (self.bytes_per_block_layer,)
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block_layer(self) -> int:
        data = 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize
        scales = 2 * self.num_kv_heads * SCALE_BYTES if self.quantized else 0
        return data + scales

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
