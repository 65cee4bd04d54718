"""Wiring of the emulated engine into a worker (`python -m pdserve.worker --emulate HW`)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

from pdserve.emulate.backend import EmulatedBackend, EmulateOptions
from pdserve.emulate.link import EmulatedLink
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine


@dataclass
class Emulation:
    backend: EmulatedBackend
    push_link: EmulatedLink  # prefill -> decode KV push
    fetch_link: EmulatedLink  # kvstore -> this worker

    def counters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.backend.runner is not None:
            out.update(self.backend.runner.counters())
        out["emulate_time_scale"] = self.backend.options.time_scale
        out["emulate_torch_loaded"] = float("torch" in sys.modules)  # must stay 0
        out["emulate_push_modelled_s"] = self.push_link.modelled_s
        out["emulate_fetch_modelled_s"] = self.fetch_link.modelled_s
        return out

    def describe(self) -> dict[str, Any]:
        o = self.backend.options
        return {"hardware": o.hardware, "model_config": self.backend.shape.name,
                "costs": self.backend.costs.name, "time_scale": o.time_scale,
                "network": o.network}  # fmt: skip


def options_from_settings(s: Any) -> EmulateOptions:
    return EmulateOptions(
        hardware=s.emulate,
        model_config=s.emulate_model_config,
        profile=s.emulate_profile,
        time_scale=s.time_scale,
        network=s.emulate_network,
        dtype=s.emulate_dtype,
        wire_layers=s.emulate_kv_layers,
    )


def build_engine(
    options: EmulateOptions, model_dir: str | None, config: EngineConfig
) -> tuple[LLMEngine, Emulation]:
    """An LLMEngine whose forward pass is emulated; KV blocks from the modelled device's
    memory unless `config` sets num_blocks / kv_cache_bytes."""
    backend = EmulatedBackend.from_dir_or_spec(options, model_dir)
    if config.num_blocks is None:
        if config.kv_cache_bytes is not None:
            blocks = config.kv_cache_bytes // backend.modelled_block_bytes(config.block_size)
        else:
            blocks = backend.num_blocks(config.block_size)
        config = replace(config, num_blocks=max(2, int(blocks)))
    llm = LLMEngine(config, backend=backend)
    wire_block = llm.spec.bytes_per_block
    ratio = backend.modelled_block_bytes(config.block_size) / wire_block
    scale = options.time_scale
    return llm, Emulation(
        backend,
        EmulatedLink(backend.transfer_link(), ratio, scale),
        EmulatedLink(backend.kvstore_fetch_link(), ratio, scale),
    )
