"""The real forward pass: a loaded checkpoint, its paged KV tensors and `ModelRunner`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pdserve.dtypes import torch_dtype
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.kv.spec import KVSpec, LayerKV
from pdserve.model.loader import allocate_kv_caches

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig


class TorchBackend:
    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded  # pdserve.model.loader.LoadedModel
        self.config = loaded.config
        self.fingerprint: str = loaded.fingerprint
        self.dtype: str = str(loaded.dtype).removeprefix("torch.")

    def kv_spec(self, block_size: int, kv_dtype: str | None = None) -> KVSpec:
        """One LayerKV per stored layer (KV-shared layers store none; K = V layers V only).
        kv_dtype: None = the weights' dtype; "int8" | "fp8_e4m3" (kv/quant.py)."""
        return KVSpec.for_layers(
            [
                LayerKV(s.num_kv_heads, s.head_dim, s.window, 1 if s.k_eq_v else 2)
                for s in self.config.kv_layers()
            ],
            block_size=block_size,
            dtype=kv_dtype or str(self.loaded.dtype).removeprefix("torch."),
        )

    def make_runner(
        self, spec: KVSpec, num_blocks: int, config: EngineConfig, window_blocks: int = 0
    ) -> ModelRunner:
        """window_blocks > 0: the sliding layers (spec.in_window_group) get their own caches
        of window_blocks + 1 blocks (block 0 = the null block: zero, never written)."""
        gen = None if config.seed is None else torch.Generator().manual_seed(config.seed)
        if window_blocks:
            kv_caches = [
                torch.zeros(
                    (
                        window_blocks + 1 if spec.in_window_group(i) else num_blocks,
                        *spec.layer_block_shape(i),
                    ),
                    dtype=torch_dtype(spec.dtype),
                    device=config.device,
                )
                for i in range(spec.num_layers)
            ]
        else:
            kv_caches = allocate_kv_caches(
                self.config, num_blocks, config.block_size, spec.dtype, config.device
            )
        return ModelRunner(
            self.loaded.model,
            kv_caches,
            config.block_size,
            config.device,
            Sampler(gen),
            batch_invariant=config.batch_invariant,
            window_group=window_blocks > 0,
            kernel_settings=config.kernels,
        )
