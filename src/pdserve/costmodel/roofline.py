"""Roofline step costs: an engine step's time on an accelerator from its peak FLOP/s and
memory bandwidth, scaled by efficiency factors, plus a per-layer and per-step floor.

One engine step (batch of (start, new) entries, `plan_features`), three terms:
    dense = max(2 * (layer_params * new_tokens + head_params * sequences) / (peak * compute),
                (layer_params + head_params) * itemsize / (mem_bw * memory))
    attn  = max(4 * layers * heads * head_dim * attention_pairs / (peak * attention_compute),
                context_tokens * kv_bytes_per_token / (mem_bw * attention_memory))
    step_s = step_overhead_s + layers * layer_overhead_s + dense + attn
Matmuls and attention are separate kernels, each bound by its own resource (a mixed step's
matmuls can be compute-bound while its decodes' KV reads are memory-bound), so their times
add. The lm_head runs once per sequence (the engine computes logits only where it samples).
The efficiencies and floors come from `calibration.json` for the accelerators it covers
(fitted on published measurements: `calibration.py`, docs/studies/published-calibration.md),
else from DEFAULT_EFFICIENCY (assumed fractions typical of vLLM-class engines).
KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * KV dtype bytes, the KV
dtype apart from the weights' (`kv_dtype`: fp8/int8 KV halves the bytes a decode step reads,
the KV that fits beside the weights, and what moves prefill -> decode; pdserve's quantized KV
adds one float32 scale per block, K/V and kv head: `shapes.kv_bytes_per_token_of`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from pdserve.costmodel.calibration import DEFAULT_EFFICIENCY, efficiency_for
from pdserve.costmodel.costs import CostModel, LinkCost, StepCost, plan_features
from pdserve.costmodel.hardware import NETWORKS, Accelerator, parse_hardware
from pdserve.costmodel.pools import ANY, ROLES, PoolHardware
from pdserve.costmodel.shapes import (
    ModelShape,
    itemsize_of,
    kv_bytes_per_token_of,
    load_model_config,
)

__all__ = ["DEFAULT_EFFICIENCY", "RooflineStep", "pool_costs", "roofline_costs"]


@dataclass(frozen=True)
class RooflineStep:
    """Step cost of `model` on `tp` x `hw` (tensor parallel; its all-reduces not modelled).
    `lm_head=False` leaves the lm_head out (what per-layer operator data covers)."""

    model: ModelShape
    hw: Accelerator
    itemsize: int = 2
    tp: int = 1
    compute_eff: float = DEFAULT_EFFICIENCY["compute"]
    memory_eff: float = DEFAULT_EFFICIENCY["memory"]
    step_overhead_s: float = DEFAULT_EFFICIENCY["step_overhead_s"]
    kv_bytes: int = 0  # KV bytes per token (0 = the weights' itemsize)
    attn_compute_eff: float = DEFAULT_EFFICIENCY["attention_compute"]
    attn_memory_eff: float = DEFAULT_EFFICIENCY["attention_memory"]
    layer_overhead_s: float = DEFAULT_EFFICIENCY["layer_overhead_s"]
    lm_head: bool = True

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes or self.model.kv_bytes_per_token(self.itemsize)

    @property
    def peak_flops(self) -> float:
        tflops = (
            self.hw.fp8_tflops if self.itemsize == 1 and self.hw.fp8_tflops else self.hw.bf16_tflops
        )
        return tflops * 1e12 * self.tp

    @property
    def mem_bw(self) -> float:
        return self.hw.mem_bw_TBps * 1e12 * self.tp

    def step_s(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        return self.features_s(plan_features(batch))

    def features_s(self, features: tuple[float, float, float, float, float]) -> float:
        """A non-empty step from its `plan_features`."""
        _, new, seqs, ctx, pairs = features
        m = self.model
        head = m.head_params if self.lm_head else 0
        layers = m.matmul_params - m.head_params
        dense_c = 2.0 * (layers * new + head * seqs) / (self.peak_flops * self.compute_eff)
        dense_m = (layers + head) * self.itemsize / (self.mem_bw * self.memory_eff)
        attn_flops = 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs
        attn_c = attn_flops / (self.peak_flops * self.attn_compute_eff)
        attn_m = ctx * self.kv_bytes_per_token / (self.mem_bw * self.attn_memory_eff)
        floor = self.step_overhead_s + m.num_layers * self.layer_overhead_s
        return floor + max(dense_c, dense_m) + max(attn_c, attn_m)

    def kv_capacity_bytes(self, mem_fraction: float = 0.9) -> int:
        total = self.hw.mem_GB * 1e9 * self.tp * mem_fraction
        return max(0, int(total - self.model.params * self.itemsize))

    @classmethod
    def build(
        cls,
        model: ModelShape,
        hardware: str,
        dtype: str = "bfloat16",
        efficiency: dict[str, float] | None = None,
        kv_bytes: int = 0,
        lm_head: bool = True,
    ) -> RooflineStep:
        """`hardware`'s calibrated efficiencies (or the defaults), `efficiency` on top."""
        hw, tp = parse_hardware(hardware)
        eff = efficiency_for(hardware) | (efficiency or {})
        return cls(model, hw, itemsize_of(dtype), tp, eff["compute"], eff["memory"],
                   eff["step_overhead_s"], kv_bytes, eff["attention_compute"],
                   eff["attention_memory"], eff["layer_overhead_s"], lm_head)  # fmt: skip


def roofline_costs(
    model: ModelShape | str,
    hardware: str,
    network: str = "nvlink",
    dtype: str = "bfloat16",
    efficiency: dict[str, float] | None = None,
    kv_dtype: str | None = None,
) -> CostModel:
    """`dtype`: the weights'; `kv_dtype`: the KV cache's (None = the weights').
    `efficiency`: keys of DEFAULT_EFFICIENCY overriding the accelerator's calibration."""
    shape = load_model_config(model) if isinstance(model, str) else model
    _, tp = parse_hardware(hardware)
    kv_bytes = kv_bytes_per_token_of(shape, kv_dtype or dtype)
    step = RooflineStep.build(shape, hardware, dtype, efficiency, kv_bytes)
    if network not in NETWORKS:
        raise ValueError(f"unknown network {network!r}; known: {sorted(NETWORKS)}")
    net = NETWORKS[network]
    window, window_bytes = shape.window_group(itemsize_of(kv_dtype or dtype)) or (0, 0)
    costs = CostModel(
        step=step,  # type: ignore[arg-type]  # duck-typed: step_s, features_s
        transfer=LinkCost(net.latency_s, net.bandwidth_GBps * 1e9 * tp),
        kvstore_fetch=LinkCost(20e-6, 25e9),  # host memory over PCIe Gen5 x16 (~25 GB/s used)
        kvstore_publish=LinkCost(20e-6, 25e9),
        router_overhead_s=0.0005,
        kv_bytes_per_token=kv_bytes,
        kv_window=window,
        kv_window_bytes_per_token=window_bytes,
        name=f"{shape.name}@{hardware}/{dtype}" + (f"/kv={kv_dtype}" if kv_dtype else ""),
        kv_capacity_bytes=step.kv_capacity_bytes(),
        devices=tp,
    )
    if costs.kv_capacity_bytes <= 0:
        raise ValueError(f"{shape.name} in {dtype} does not fit on {hardware}: use NAMExTP")
    return costs


def pool_costs(
    model: str,
    hardware: str,
    network: str = "nvlink",
    dtype: str = "bfloat16",
    efficiency: dict[str, float] | None = None,
    kv_dtype: str | None = None,
) -> dict[str, CostModel | list[CostModel]]:
    """Per-role costs of a `costmodel.pools` hardware spec: 'h100' for every pool,
    'PREFILL_HW,DECODE_HW' (colocated instances use the first), or 'ROLE=HW[+HW...]'. A role
    dealt several types gets a list, one CostModel per type in the order its workers are
    dealt them (they cycle); a role not named gets the prefill pool's (else the first's)."""
    hw = PoolHardware.parse(hardware)
    made: dict[str, CostModel] = {}

    def cost(name: str) -> CostModel:
        if name not in made:
            made[name] = roofline_costs(model, name, network, dtype, efficiency, kv_dtype)
        return made[name]

    out: dict[str, CostModel | list[CostModel]] = {}
    for role in ROLES:
        names = (hw.pools.get(role) or hw.pools.get(ANY) or hw.pools.get("prefill")
                 or next(iter(hw.pools.values())))  # fmt: skip
        costs = [cost(n) for n in names]
        out[role] = costs[0] if len(costs) == 1 else costs
    return out


def calibrate(profile: dict[str, Any], peak_flops: float, mem_bw_Bps: float) -> dict[str, float]:
    """Efficiency factors of a real profile against its machine's limits: the compute
    efficiency from a 512-token prefill step, the memory efficiency from a 16 x 512-context
    decode step (both from the fitted step model, overhead excluded)."""
    st = StepCost(**{k: v for k, v in profile["costs"]["step"].items()
                     if k in StepCost.__dataclass_fields__})  # fmt: skip
    eng = profile["engine"]
    params = eng["params"]
    mc = eng["model_config"]
    itemsize = 2 if "16" in mc["dtype"] else 4
    pre = st.step_s([(0, 512)]) - st.base_s
    dec = st.step_s([(512, 1)] * 16) - st.base_s
    flops = 2.0 * params * 512
    nbytes = params * itemsize + 16 * 513 * eng["kv_bytes_per_token"]
    compute = min(1.0, flops / pre / peak_flops) if pre > 0 else math.nan
    memory = min(1.0, nbytes / dec / mem_bw_Bps) if dec > 0 else math.nan
    return {"compute": compute, "memory": memory, "attention_compute": compute,
            "attention_memory": memory, "step_overhead_s": st.base_s,
            "layer_overhead_s": 0.0}  # fmt: skip


def with_efficiency(step: RooflineStep, eff: dict[str, float]) -> RooflineStep:
    e = DEFAULT_EFFICIENCY | eff
    return replace(step, compute_eff=e["compute"], memory_eff=e["memory"],
                   attn_compute_eff=e["attention_compute"],
                   attn_memory_eff=e["attention_memory"], step_overhead_s=e["step_overhead_s"],
                   layer_overhead_s=e["layer_overhead_s"])  # fmt: skip
