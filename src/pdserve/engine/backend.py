"""The one point where the forward pass is chosen: a `ForwardBackend` gives the engine its
model facts (config, fingerprint, KV layout) and builds its `Runner`. Torch-free.

- real: `engine.torch_backend.TorchBackend` (a loaded checkpoint; `runner.ModelRunner`);
- emulated: `emulate.backend.EmulatedBackend` (a step whose duration a cost model gives;
  no torch imported).

The scheduler, `KVCacheManager`, every block reference and every engine command are the same
for both: only `Runner.execute` and the KV buffers behind `read_*`/`write_layer` differ.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.scheduler import SchedulerPlan
    from pdserve.kv.spec import KVSpec
    from pdserve.model.config import ModelConfig


class Runner(Protocol):
    def execute(
        self, plan: SchedulerPlan, layer_callback: Callable[[int], None] | None = None
    ) -> dict[str, int]:
        """Run one step; request_id -> sampled token for entries with `sample`.
        `layer_callback(l)` runs once layer l of the step's KV is in the cache."""
        ...

    def read_layer(self, layer: int, block_ids: list[int]) -> Any:
        """[n, 2, block_size, kv_heads, head_dim], a contiguous CPU copy."""
        ...

    def write_layer(self, layer: int, block_ids: list[int], kv: Any) -> None: ...

    def read_blocks(self, block_ids: list[int]) -> Any:
        """[n, L, 2, block_size, kv_heads, head_dim], a CPU copy."""
        ...

    def empty_kv(self, shape: Sequence[int]) -> Any:
        """An uninitialised CPU buffer of the KV dtype (UCX receives, kvstore fetches)."""
        ...


class ForwardBackend(Protocol):
    config: ModelConfig
    fingerprint: str  # weights identity + dtype (emulated: the model config's identity)
    dtype: str  # the compute (weights') dtype served, resolved: never "auto"

    def kv_spec(self, block_size: int, kv_dtype: str | None = None) -> KVSpec:
        """The KV layout this engine holds and moves (emulated: a few bytes per block)."""
        ...

    def make_runner(self, spec: KVSpec, num_blocks: int, config: EngineConfig) -> Runner: ...
