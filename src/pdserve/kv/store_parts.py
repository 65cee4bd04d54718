"""A layered KV block as the kvstore keeps it: a main part and a window part. Torch-free.

A layered spec with a sliding window group (`KVSpec.window_group` = W; Gemma 4) moves blocks
to and from the kvstore in two parts (kvstore/window.py): the *main* part = the stored layers
of the full group (full attention), the *window* part = the sliding layers. Each part is the
concatenation, in stored-layer order, of its layers' bytes of one block (`KVSpec.layer_offsets`
times the itemsize), so a whole block `[elems_per_block]` splits and joins without loss.

Only the last `window_blocks(spec)` blocks of a published chain carry a window part:
ceil(W / bs) blocks is what a hit at the chain's end reads ([k - ceil(W / bs), k)), and one
more lets the hit one block shorter be served too (a prompt that ends exactly at the chain's
end recomputes its last token, so the engine's hit is k - 1). Uniform specs (and layered
specs without one sliding window) have no window part: `window_blocks` = 0, whole blocks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pdserve.kv.spec import KVSpec
from pdserve.kv.transfer_buffers import as_bytes


def window_blocks(spec: KVSpec) -> int:
    """Blocks at a chain's end that get a window part in the kvstore (0: whole blocks)."""
    w = spec.window_group
    return 0 if w is None else -(-w // spec.block_size) + 1


def part_bytes(spec: KVSpec) -> tuple[int, int]:
    """(main part, window part) bytes of one block."""
    return spec.group_block_bytes()


def _ranges(spec: KVSpec) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Byte ranges inside a whole block of the main layers and of the window layers."""
    main: list[tuple[int, int]] = []
    window: list[tuple[int, int]] = []
    for i, (a, b) in enumerate(spec.layer_offsets()):
        rng = (a * spec.itemsize, b * spec.itemsize)
        (window if spec.in_window_group(i) else main).append(rng)
    return main, window


def _rows(buf: Any, n: int, width: int) -> np.ndarray:
    """`buf` (n whole blocks: numpy or CPU torch, contiguous) as an [n, width] byte view."""
    return as_bytes(buf, writable=True).reshape(n, width) if n else np.empty((0, width), np.uint8)


def split(spec: KVSpec, blocks: Any, n: int) -> tuple[np.ndarray, np.ndarray]:
    """`n` whole blocks (shaped spec.blocks_shape(n)) -> (main [n, main B], window [n, win B])."""
    main_b, win_b = part_bytes(spec)
    rows = _rows(blocks, n, spec.bytes_per_block)
    main_r, win_r = _ranges(spec)
    out_main, out_win = np.empty((n, main_b), np.uint8), np.empty((n, win_b), np.uint8)
    for out, ranges in ((out_main, main_r), (out_win, win_r)):
        pos = 0
        for a, b in ranges:
            out[:, pos : pos + b - a] = rows[:, a:b]
            pos += b - a
    return out_main, out_win


def join(spec: KVSpec, main: np.ndarray, window: np.ndarray, out: Any) -> None:
    """Fill `out` (k whole blocks, spec.blocks_shape(k)) from main parts [k, main B] and the
    window parts [t, win B] of its last t blocks; the window layers of blocks [0, k - t) are
    zeroed (they carry no KV: the importer must not register them, `window_from`)."""
    k, t = main.shape[0], window.shape[0]
    rows = _rows(out, k, spec.bytes_per_block)
    main_r, win_r = _ranges(spec)
    pos = 0
    for a, b in main_r:
        rows[:, a:b] = main[:, pos : pos + b - a]
        pos += b - a
    pos = 0
    for a, b in win_r:
        rows[: k - t, a:b] = 0
        rows[k - t :, a:b] = window[:, pos : pos + b - a]
        pos += b - a
