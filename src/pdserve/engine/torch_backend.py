"""The real forward pass: a loaded checkpoint, its paged KV tensors and `ModelRunner`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from pdserve.engine.runner import ModelRunner
from pdserve.engine.sampler import Sampler
from pdserve.kv.spec import KVSpec
from pdserve.model.loader import allocate_kv_caches

if TYPE_CHECKING:
    from pdserve.engine.engine import EngineConfig


class TorchBackend:
    def __init__(self, loaded: Any) -> None:
        self.loaded = loaded  # pdserve.model.loader.LoadedModel
        self.config = loaded.config
        self.fingerprint: str = loaded.fingerprint

    def kv_spec(self, block_size: int) -> KVSpec:
        mc = self.config
        return KVSpec(
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_size=block_size,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
        )

    def make_runner(self, spec: KVSpec, num_blocks: int, config: EngineConfig) -> ModelRunner:
        gen = None if config.seed is None else torch.Generator().manual_seed(config.seed)
        kv_caches = allocate_kv_caches(
            self.config, num_blocks, config.block_size, spec.dtype, config.device
        )
        return ModelRunner(
            self.loaded.model, kv_caches, config.block_size, config.device, Sampler(gen)
        )
