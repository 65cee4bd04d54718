"""kv/store_parts: a layered block splits into main + window parts and joins back without loss;
uniform specs have no window part."""

from __future__ import annotations

import numpy as np
import torch

from pdserve.kv import store_parts
from pdserve.kv.spec import KVSpec, LayerKV

BS = 16
# Gemma 4-like: sliding (2 x 16, window 24), full K = V (1 x 32), sliding, sliding
LAYERS = [LayerKV(2, 16, 24), LayerKV(2, 16, 24), LayerKV(1, 32, None, 1), LayerKV(2, 16, 24)]


def test_window_blocks_and_part_bytes() -> None:
    spec = KVSpec.for_layers(LAYERS, BS, "float32")
    assert store_parts.window_blocks(spec) == 2 + 1  # ceil(24 / 16) + 1
    main_b, win_b = store_parts.part_bytes(spec)
    assert (main_b, win_b) == (BS * 32 * 4, 3 * 2 * BS * 2 * 16 * 4)
    assert main_b + win_b == spec.bytes_per_block
    uniform = KVSpec.for_layers([LayerKV(2, 16, 24)] * 3, BS, "float32")  # Mistral-like
    assert uniform.layers is None and store_parts.window_blocks(uniform) == 0


def test_split_join_roundtrip_zeroes_the_unfetched_window_layers() -> None:
    spec = KVSpec.for_layers(LAYERS, BS, "bfloat16")
    n = 5
    blocks = torch.randn(spec.blocks_shape(n)).to(torch.bfloat16)
    main, window = store_parts.split(spec, blocks, n)
    assert main.shape == (n, store_parts.part_bytes(spec)[0])
    # each part is its layers' bytes in stored-layer order
    raw = blocks.view(torch.uint8).numpy().reshape(n, -1)
    offs = [(a * 2, b * 2) for a, b in spec.layer_offsets()]
    np.testing.assert_array_equal(main, raw[:, offs[2][0] : offs[2][1]])
    np.testing.assert_array_equal(
        window, np.concatenate([raw[:, a:b] for i, (a, b) in enumerate(offs) if i != 2], 1)
    )
    out = torch.empty(spec.blocks_shape(n), dtype=torch.bfloat16)
    store_parts.join(spec, main, window, out)
    assert torch.equal(out.view(torch.uint8), blocks.view(torch.uint8))
    # only the last 2 blocks' window parts: the others' sliding layers are zero
    store_parts.join(spec, main, window[3:], out)
    got = out.view(torch.uint8).numpy().reshape(n, -1)
    np.testing.assert_array_equal(got[3:], raw[3:])
    np.testing.assert_array_equal(
        got[:3, offs[2][0] : offs[2][1]], raw[:3, offs[2][0] : offs[2][1]]
    )
    for i, (a, b) in enumerate(offs):
        if i != 2:
            assert not got[:3, a:b].any()
