"""EmulatedBackend: the engine's ForwardBackend for a modelled model on modelled hardware.

What it models (from `pdserve.sim`): the step time (the roofline of `hardware` for the model
config, or a `pdserve profile` file's fitted step), the KV capacity (device memory minus the
weights, in blocks of the modelled size) and the KV link (`--network`). What it holds: a few
bytes of KV per block (the wire layout below), so that KV moves over UCX and the kvstore and
is checked, at a tiny fraction of the modelled bytes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.costmodel.costs import CostModel, LinkCost
from pdserve.costmodel.roofline import roofline_costs
from pdserve.costmodel.shapes import BUILTIN_CONFIGS, ModelShape, itemsize_of
from pdserve.emulate.runner import Clock, EmulatedRunner
from pdserve.kv.spec import KVSpec
from pdserve.model.config import ModelConfig

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig


@dataclass(frozen=True)
class EmulateOptions:
    hardware: str  # h100, h200, a100, l40s, mi300x; NAMExTP for tensor parallel
    model_config: str | None = None  # built-in name (llama3-8b, ...) or config.json / dir
    profile: str | None = None  # `pdserve profile` JSON: its step and link costs instead
    time_scale: float = 1.0  # wall seconds per modelled second
    network: str = "nvlink"  # the KV push link (costmodel.hardware.NETWORKS)
    dtype: str = "bfloat16"  # the modelled serving dtype
    wire_layers: int = 1  # KV messages per push (one per wire layer)
    wire_head_dim: int = 1  # wire bytes per block per layer = 2 * block_size * head_dim * 2


def read_model_config(spec: str | None, model_dir: str | None) -> dict[str, Any]:
    """config.json fields: a built-in name, a config.json or directory, else `model_dir`'s."""
    if spec and spec.lower() in BUILTIN_CONFIGS:
        raw = dict(BUILTIN_CONFIGS[spec.lower()])
        raw.setdefault("_name_or_path", spec.lower())
        return raw
    path = Path(spec or model_dir or "")
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"unknown model config {spec or model_dir!r}: one of {sorted(BUILTIN_CONFIGS)}, "
            "a config.json, or a model directory"
        )
    return json.loads(path.read_text())


class EmulatedBackend:
    def __init__(
        self,
        options: EmulateOptions,
        raw_config: dict[str, Any],
        generation_config: dict[str, Any] | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.options = options
        self.dtype: str = options.dtype  # the modelled compute dtype
        self.raw_config = raw_config
        self.config = ModelConfig.from_dict(raw_config, generation_config)
        self.shape = ModelShape.from_config(raw_config)
        self.clock = clock
        self.costs = self._costs()
        text = "|".join(["pdserve-emulated-v1", json.dumps(raw_config, sort_keys=True),
                         options.dtype])  # fmt: skip
        # the model's identity, not the hardware's: prefill and decode pools of different
        # hardware share KV, as real ones serving the same weights do
        self.fingerprint = hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        self.runner: EmulatedRunner | None = None

    @classmethod
    def from_dir_or_spec(
        cls, options: EmulateOptions, model_dir: str | None, clock: Clock | None = None
    ) -> EmulatedBackend:
        raw = read_model_config(options.model_config, model_dir)
        gen: dict[str, Any] = {}
        if model_dir and not options.model_config:
            gen_path = Path(model_dir) / "generation_config.json"
            if gen_path.is_file():
                gen = json.loads(gen_path.read_text())
        return cls(options, raw, gen, clock)

    def _costs(self) -> CostModel:
        o = self.options
        if o.profile:
            prof = json.loads(Path(o.profile).read_text())
            costs = CostModel.from_json(prof["costs"])
            if costs.kv_capacity_bytes is None:
                eng = prof.get("engine", {})
                blocks = int(eng.get("num_blocks_default") or 0)
                costs.kv_capacity_bytes = (
                    blocks * costs.kv_bytes_per_token * int(eng.get("block_size") or 16)
                )
            return costs
        return roofline_costs(self.shape, o.hardware, o.network, o.dtype)

    # ---- modelled sizes --------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        if self.costs.kv_bytes_per_token:
            return self.costs.kv_bytes_per_token
        return self.shape.kv_bytes_per_token(itemsize_of(self.options.dtype))

    def modelled_block_bytes(self, block_size: int) -> int:
        return self.kv_bytes_per_token * block_size

    def num_blocks(self, block_size: int) -> int:
        """KV blocks of the modelled device: its memory (90 %) minus the weights."""
        cap = self.costs.kv_capacity_bytes or 0
        return max(2, cap // self.modelled_block_bytes(block_size))

    def transfer_link(self) -> LinkCost:
        return self.costs.transfer

    def kvstore_fetch_link(self) -> LinkCost:
        return self.costs.kvstore_fetch

    # ---- ForwardBackend -----------------------------------------------------------------
    def kv_spec(self, block_size: int, kv_dtype: str | None = None) -> KVSpec:
        # The wire KV is a few checked bytes per block whatever kv_dtype says; the modelled
        # KV bytes (capacity, transfer time) come from the cost model.
        o = self.options
        return KVSpec(o.wire_layers, 1, o.wire_head_dim, block_size, "float16")

    def make_runner(self, spec: KVSpec, num_blocks: int, config: EngineConfig) -> EmulatedRunner:
        self.runner = EmulatedRunner(
            self.costs,
            self.config.vocab_size,
            num_blocks,
            spec.block_size,
            spec.num_layers,
            spec.head_dim,
            self.options.time_scale,
            self.clock,
        )
        return self.runner
