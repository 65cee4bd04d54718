"""KVSpec: the paged KV layout shared by every process that holds or moves KV. Torch-free.

Per stored layer the cache is one tensor `[num_blocks, 2, block_size, kv_heads_l, head_dim_l]`
(flashinfer NHD paged layout; index 0 of dim 1 is K, 1 is V), or `[num_blocks, 1, ...]` (V only)
on a Gemma 4 K = V layer. "Stored layers" are the model
layers that own KV: a KV-shared layer (Gemma 4) reads another layer's cache and stores none,
so `num_layers` counts stored layers only.

Uniform models (every stored layer the same shape, `layers` None) keep the classic block
layout: a block moved between processes is `[num_layers, 2, block_size, kv_heads, head_dim]`.
Models whose layers differ (Gemma 4: sliding vs full layers with other head dims / KV heads)
give `layers`, one LayerKV per stored layer; a block is then the flat concatenation of every
stored layer's `[2, block_size, kv_heads_l, head_dim_l]` elements, `[elems_per_block]` (the
uniform layout is the same bytes, viewed with more axes).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from pdserve.dtypes import ITEMSIZE as _ITEMSIZE

KV_LAYOUT = "NHD:[blocks,2,block_size,kv_heads,head_dim]"
# quantized KV (pdserve.kv.quant): a block of a layer is one row of elements + per-head scales
QUANT_KV_DTYPES = ("int8", "fp8_e4m3")
SCALE_BYTES = 4


@dataclass(frozen=True)
class LayerKV:
    """One stored layer's KV shape."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window in tokens (None = full attention)
    kv_tensors: int = 2  # 2 = K and V; 1 = V only (Gemma 4 K = V layers rebuild K on read)


@dataclass(frozen=True)
class KVSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # the KV dtype: "float32" | "bfloat16" | "float16" | "int8" | "fp8_e4m3"
    layers: tuple[LayerKV, ...] | None = None  # per stored layer; None = uniform

    def __post_init__(self) -> None:
        if self.dtype not in _ITEMSIZE and self.dtype not in QUANT_KV_DTYPES:
            names = sorted(_ITEMSIZE) + list(QUANT_KV_DTYPES)
            raise ValueError(f"dtype must be one of {names}, got {self.dtype!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.layers is not None and len(self.layers) != self.num_layers:
            raise ValueError("len(layers) must equal num_layers")
        if self.layers is not None and self.quantized:
            # the quantized row layout (elements + per-head scales) is per uniform layer
            raise ValueError(f"kv dtype {self.dtype}: quantized KV supports uniform layouts only")

    @classmethod
    def for_layers(cls, layers: list[LayerKV], block_size: int, dtype: str) -> KVSpec:
        """The spec of these stored layers: uniform (layers None) when all have one shape, so
        classic models (Mistral's all-layer window included) keep their layout, fingerprint
        and whole-prompt transfer; only layered specs trim sliding layers to their window."""
        first = layers[0]
        uniform = all(
            (x.num_kv_heads, x.head_dim, x.kv_tensors) == (first.num_kv_heads, first.head_dim, 2)
            for x in layers
        )
        return cls(
            num_layers=len(layers),
            num_kv_heads=first.num_kv_heads,
            head_dim=first.head_dim,
            block_size=block_size,
            dtype=dtype,
            layers=None if uniform else tuple(layers),
        )

    @property
    def uniform(self) -> bool:
        return self.layers is None

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANT_KV_DTYPES

    @property
    def itemsize(self) -> int:
        return 1 if self.quantized else _ITEMSIZE[self.dtype]

    def layer(self, i: int) -> LayerKV:
        return LayerKV(self.num_kv_heads, self.head_dim) if self.layers is None else self.layers[i]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block in one layer (uniform specs): (2, block_size, kv_heads, head_dim);
        for a quantized dtype one raw row of bytes: (bytes_per_block_layer,) (pdserve.kv.quant)."""
        if self.layers is not None:
            raise ValueError("layers differ in shape: use layer_block_shape(layer)")
        if self.quantized:
            return (self.bytes_per_block_layer,)
        return (2, self.block_size, self.num_kv_heads, self.head_dim)

    def layer_block_shape(self, i: int) -> tuple[int, ...]:
        if self.quantized:  # uniform by construction: one raw row of bytes (kv/quant.py)
            return (self.bytes_per_block_layer,)
        x = self.layer(i)
        return (x.kv_tensors, self.block_size, x.num_kv_heads, x.head_dim)

    def layer_block_elems(self, i: int) -> int:
        if self.quantized:  # elements are bytes (itemsize 1), scales included
            return self.bytes_per_block_layer
        x = self.layer(i)
        return x.kv_tensors * self.block_size * x.num_kv_heads * x.head_dim

    @property
    def bytes_per_block_layer(self) -> int:
        if self.layers is not None:
            raise ValueError("layers differ in shape: use layer_block_elems(layer)")
        data = 2 * self.block_size * self.num_kv_heads * self.head_dim * self.itemsize
        scales = 2 * self.num_kv_heads * SCALE_BYTES if self.quantized else 0
        return data + scales

    @property
    def elems_per_block(self) -> int:
        return sum(self.layer_block_elems(i) for i in range(self.num_layers))

    @property
    def bytes_per_block(self) -> int:
        if self.quantized:
            return self.num_layers * self.bytes_per_block_layer
        return self.elems_per_block * self.itemsize

    def blocks_shape(self, n: int) -> tuple[int, ...]:
        """Shape of `n` whole blocks (every stored layer) as the kvstore and block export
        move them: uniform [n, L, 2, bs, kvh, hd], else [n, elems_per_block]."""
        if self.layers is None:
            return (n, self.num_layers, *self.block_shape)
        return (n, self.elems_per_block)

    def layer_offsets(self) -> list[tuple[int, int]]:
        """(start, end) element range of each stored layer inside one flat block."""
        out, start = [], 0
        for i in range(self.num_layers):
            end = start + self.layer_block_elems(i)
            out.append((start, end))
            start = end
        return out

    def first_needed_block(self, layer: int, num_tokens: int) -> int:
        """First block of stored `layer` that decoding after `num_tokens` tokens can read: 0
        for full attention; a sliding layer of window W reads keys at positions > p - W from
        query p >= num_tokens, so it needs tokens [num_tokens - W, num_tokens) only. The
        prefill -> decode transfer moves blocks [first_needed_block, ceil(n / bs)) per layer."""
        w = self.layer(layer).window
        return 0 if w is None else max(0, num_tokens - w) // self.block_size

    @property
    def window_group(self) -> int | None:
        """The window W of the sliding group of a layered spec: its sliding layers then live
        in their own block pool (KVCacheManager), whose blocks before the window are freed.
        None for uniform specs (one group, today's layout: Mistral's all-layer window too),
        for layered specs without sliding layers, and when sliding windows differ."""
        if self.layers is None:
            return None
        windows = {x.window for x in self.layers if x.window is not None}
        return windows.pop() if len(windows) == 1 else None

    def in_window_group(self, layer: int) -> bool:
        """True when stored `layer` lives in the sliding group's pool (see window_group)."""
        return self.window_group is not None and self.layer(layer).window is not None

    def group_block_bytes(self) -> tuple[int, int]:
        """Bytes of one block of the full group and of the sliding group (0 without one)."""
        full = window = 0
        for i in range(self.num_layers):
            b = self.layer_block_elems(i) * self.itemsize
            if self.in_window_group(i):
                window += b
            else:
                full += b
        return full, window

    def trimmed_blocks(self, num_tokens: int) -> int:
        """Leading blocks that a transfer of `num_tokens` tokens leaves incomplete in some layer
        (the receiver must never offer them as cached prefix)."""
        return max((self.first_needed_block(i, num_tokens) for i in range(self.num_layers)),
                   default=0)  # fmt: skip

    def transfer_bytes(self, num_tokens: int) -> int:
        """KV bytes a prefill of `num_tokens` tokens sends to its decode (every stored layer,
        sliding layers their window only)."""
        from pdserve.kv.footprint import KVLayer, kv_bytes

        layers = [
            KVLayer(x.num_kv_heads, x.head_dim, x.window, k_eq_v=x.kv_tensors == 1)
            for x in map(self.layer, range(self.num_layers))
        ]
        return kv_bytes(layers, num_tokens, self.itemsize, self.block_size, "transfer")

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens (ceil division)."""
        return -(-num_tokens // self.block_size)

    def kv_fingerprint(self, model_fingerprint: str) -> str:
        """The kv_fingerprint: block hashes are chained from it and the kvstore keys blocks by
        it (its wire field `namespace`). Two processes share KV blocks only if
        their weights identity, dtype, block size and KV layout all match."""
        parts = [
            "pdserve-kv-v1",
            model_fingerprint,
            self.dtype,
            f"bs={self.block_size}",
            f"L={self.num_layers}",
            f"kvh={self.num_kv_heads}",
            f"hd={self.head_dim}",
            KV_LAYOUT,
        ]
        if self.layers is not None:
            parts.append(
                "layers="
                + ",".join(
                    f"{x.kv_tensors}x{x.num_kv_heads}x{x.head_dim}w{x.window}" for x in self.layers
                )
            )
        return hashlib.blake2b("|".join(parts).encode("utf-8"), digest_size=16).hexdigest()
