"""KV bytes of a request by layer type and stage: the one place that computes them. Torch-free.

Used by the engine's KVSpec (transfer sizes), the cost model (`costmodel.shapes.ModelShape`) and the
bench cost models. Stages (what each holds for a request of n tokens, block granularity):
- naive:     every model layer, K and V, every block (the all-layers layout);
- one_pool:  a paged cache with one block pool for every layer (`EngineConfig(window_pool=
             False)`, and every uniform model): layers that store KV only (KV-shared layers
             read their source's), K and V (V only on K = V layers), every block;
- cache:     what the engine's paged cache holds: as one_pool, but the sliding layers of a
             layered layout (kv/window_group.py) hold their window only, blocks
             [(n - W) // bs, ceil(n / bs)), the earlier ones freed as the window moves;
- transfer:  prefill -> decode: as cache (a sliding layer sends its last window only);
- store:     what the kvstore holds for the request's chain (kvstore/window.py): as one_pool
             for the full-attention layers, every block; the sliding layers of a layered
             layout (one sliding window W) only the last ceil(W / bs) + 1 blocks (the
             window a hit at the chain's end reads, plus one block so that the hit one
             block shorter is served too: kv/store_parts.py). The store keeps full blocks
             only: for n not a multiple of bs the store holds the n // bs-block figure.
Trimming to the window applies to layered layouts only (stored layers of different shapes,
as `KVSpec.for_layers` decides, with one sliding window for the cache and the store): a
uniform model (Mistral's all-layer window) keeps, sends and stores every block.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

STAGES = ("naive", "one_pool", "cache", "transfer", "store")


@dataclass(frozen=True)
class KVLayer:
    """One model layer's KV: its shape, window, and whether it owns KV at all."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None  # sliding window in tokens (None = full attention)
    shared: bool = False  # reads another layer's KV, stores none
    k_eq_v: bool = False  # V is the (normed) K projection: one tensor would do


def layers_of(config: Any) -> list[KVLayer]:
    """Per model layer, from a pdserve ModelConfig."""
    out = []
    for i in range(config.num_layers):
        s = config.layer_kv(i)
        out.append(KVLayer(s.num_kv_heads, s.head_dim, s.window, s.source != i, s.k_eq_v))
    return out


def _blocks(layer: KVLayer, n: int, bs: int, trim: bool, stage: str) -> int:
    nb = -(-n // bs)
    if trim and layer.window is not None:
        if stage == "store":  # the last window + 1 block (kv/store_parts.window_blocks)
            return min(nb, -(-layer.window // bs) + 1)
        return nb - max(0, n - layer.window) // bs
    return nb


def kv_bytes(
    layers: Sequence[KVLayer], num_tokens: int, itemsize: int, block_size: int, stage: str
) -> int:
    """KV bytes of one request of `num_tokens` tokens at `stage` (see the module doc)."""
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    stored = [x for x in layers if not x.shared]
    layered = _layered(stored)
    one_window = len({x.window for x in stored if x.window is not None}) == 1
    trim = layered and (stage == "transfer" or (stage in ("cache", "store") and one_window))
    total = 0
    for x in layers:
        if x.shared and stage != "naive":
            continue
        tensors = 1 if (stage != "naive" and x.k_eq_v) else 2
        per_block = tensors * block_size * x.num_kv_heads * x.head_dim * itemsize
        total += _blocks(x, num_tokens, block_size, trim, stage) * per_block
    return total


def window_group_split(layers: Sequence[KVLayer], itemsize: int) -> tuple[int, int] | None:
    """(W, bytes per token of the sliding group) when the engine keeps the sliding layers in
    their own window pool (`KVSpec.window_group`: a layered layout with one sliding window),
    else None. The rest of the one-pool bytes per token is the main pool's."""
    stored = [x for x in layers if not x.shared]
    windows = {x.window for x in stored if x.window is not None}
    if not _layered(stored) or len(windows) != 1:
        return None
    per_token = sum(
        (1 if x.k_eq_v else 2) * x.num_kv_heads * x.head_dim * itemsize
        for x in stored
        if x.window is not None
    )
    return windows.pop(), per_token


def _layered(stored: Sequence[KVLayer]) -> bool:
    """Stored layers of different shapes (as `KVSpec.for_layers` decides)."""
    return any(
        (x.num_kv_heads, x.head_dim, x.k_eq_v)
        != (stored[0].num_kv_heads, stored[0].head_dim, False)
        for x in stored
    )


def kv_bytes_per_token(
    layers: Sequence[KVLayer],
    itemsize: int,
    stage: str = "cache",
    context: int = 4096,
    block_size: int = 16,
) -> float:
    """Average KV bytes per token of a `context`-token request at `stage`. Without sliding
    layers (or at stages that keep every block) this is the exact per-token size."""
    return kv_bytes(layers, context, itemsize, block_size, stage) / context


def report(
    layers: Sequence[KVLayer], itemsize: int, context: int, block_size: int = 16
) -> dict[str, dict[str, float]]:
    """{stage: {bytes, bytes_per_token, vs_naive}} for one request of `context` tokens."""
    naive = kv_bytes(layers, context, itemsize, block_size, "naive")
    out = {}
    for stage in STAGES:
        b = kv_bytes(layers, context, itemsize, block_size, stage)
        out[stage] = {"bytes": b, "bytes_per_token": b / context, "vs_naive": b / naive}
    return out
