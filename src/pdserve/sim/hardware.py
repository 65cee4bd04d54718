"""Hardware and models beyond this machine: roofline step costs from an accelerator's peak
FLOP/s and memory bandwidth, a model's shapes (config.json alone, no weights), and a network
model for the KV push between pools.

Roofline of one engine step (batch of (start, new) entries):
    flops = 2 * matmul_params * new_tokens + 4 * layers * heads * head_dim * attention_pairs
    bytes = weight_bytes + context_tokens * kv_bytes_per_token
    step_s = step_overhead_s + max(flops / (peak_flops * compute_eff),
                                   bytes / (mem_bw * memory_eff))
The efficiency factors default to commonly reported fractions (see DEFAULT_EFFICIENCY) and
are calibrated from a real profile with `calibrate` where one exists (only this CPU here).
KV bytes per token = 2 (K and V) * layers * kv_heads * head_dim * KV dtype bytes, the KV
dtype apart from the weights' (`kv_dtype`: fp8/int8 KV halves the bytes a decode step reads,
the KV that fits beside the weights, and what moves prefill -> decode; pdserve's quantized KV
adds one float32 scale per block, K/V and kv head: `kv_bytes_per_token_of`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.kv.footprint import KVLayer, kv_bytes_per_token, layers_of_hf, window_group_split
from pdserve.sim.costs import CostModel, LinkCost, plan_features

MODEL_CONFIG_DIR = Path(__file__).parent / "model_configs"


@dataclass(frozen=True)
class Accelerator:
    name: str
    bf16_tflops: float  # dense (no structured sparsity)
    mem_bw_TBps: float
    mem_GB: float
    source: str
    fp8_tflops: float | None = None


# Peak dense BF16 tensor FLOP/s, memory bandwidth, memory: vendor datasheets.
ACCELERATORS: dict[str, Accelerator] = {
    "h100": Accelerator(
        "NVIDIA H100 SXM5 80GB",
        989.4,
        3.35,
        80,
        "NVIDIA H100 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense), "
        "HBM3 3.35 TB/s, 80 GB",
        1978.9,
    ),
    "h200": Accelerator(
        "NVIDIA H200 SXM 141GB",
        989.4,
        4.8,
        141,
        "NVIDIA H200 Tensor Core GPU datasheet: BF16 1,979 TFLOPS with sparsity (989 dense), "
        "HBM3e 4.8 TB/s, 141 GB",
        1978.9,
    ),
    "a100": Accelerator(
        "NVIDIA A100 SXM4 80GB",
        312.0,
        2.039,
        80,
        "NVIDIA A100 Tensor Core GPU datasheet: BF16 312 TFLOPS (624 with sparsity), "
        "HBM2e 2,039 GB/s (80GB SXM), 80 GB",
    ),
    "l40s": Accelerator(
        "NVIDIA L40S 48GB",
        362.05,
        0.864,
        48,
        "NVIDIA L40S datasheet: BF16 362.05 TFLOPS (733 with sparsity), GDDR6 864 GB/s, 48 GB",
        733.0,
    ),
    "mi300x": Accelerator(
        "AMD Instinct MI300X 192GB",
        1307.4,
        5.3,
        192,
        "AMD Instinct MI300X datasheet: BF16 1,307.4 TFLOPS dense, HBM3 5.3 TB/s, 192 GB",
        2614.9,
    ),
}

# Fractions of peak an engine reaches (prefill MFU ~0.5-0.6 and decode ~0.6-0.8 of HBM
# bandwidth are typical of vLLM/SGLang-class engines on these parts; DistServe and Vidur
# calibrate per GPU). Override with `calibrate` from a real profile.
DEFAULT_EFFICIENCY = {"compute": 0.55, "memory": 0.75, "step_overhead_s": 0.002}


@dataclass(frozen=True)
class Network:
    name: str
    bandwidth_GBps: float  # one direction, per GPU
    latency_s: float
    source: str


NETWORKS: dict[str, Network] = {
    "nvlink": Network("NVLink 4 (H100/H200 HGX)", 450.0, 5e-6,
                      "NVIDIA: 900 GB/s bidirectional per GPU (450 GB/s each way)"),
    "nvlink3": Network("NVLink 3 (A100 HGX)", 300.0, 5e-6,
                       "NVIDIA: 600 GB/s bidirectional per GPU"),
    "ib": Network("InfiniBand NDR 400 Gb/s", 50.0, 5e-6,
                  "NVIDIA ConnectX-7: 400 Gb/s per port = 50 GB/s"),
    "ib-hdr": Network("InfiniBand HDR 200 Gb/s", 25.0, 5e-6, "200 Gb/s per port = 25 GB/s"),
    "eth100": Network("Ethernet 100 GbE", 12.5, 20e-6, "100 Gb/s = 12.5 GB/s"),
    "eth400": Network("Ethernet 400 GbE (RoCE)", 50.0, 10e-6, "400 Gb/s = 50 GB/s"),
    "pcie4": Network("PCIe Gen4 x16", 32.0, 5e-6, "~32 GB/s each way (L40S has no NVLink)"),
}  # fmt: skip


@dataclass(frozen=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_matrices: int = 3  # 3: gated (gate, up, down: Llama, Qwen); 2: fc1, fc2 (OPT, GPT-2)
    # per model layer KV (kv.footprint) when layers differ (Gemma 4); None = uniform
    kv_layers: tuple[KVLayer, ...] | None = None
    kv_context: int = 4096  # context at which a layered model's bytes per token are taken

    @property
    def matmul_params(self) -> int:
        """Parameters touched by a token's matmuls (every layer + lm_head; not the embedding
        gather)."""
        h, a, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        attn = h * a + 2 * h * kv + a * h + (a + 2 * kv if self.attention_bias else 0)
        mlp = self.mlp_matrices * h * self.intermediate_size
        return self.num_layers * (attn + mlp + 2 * h) + self.vocab_size * h + h

    @property
    def params(self) -> int:
        emb = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.matmul_params + emb

    def kv_bytes_per_token(self, itemsize: int) -> int:
        """Engine cache bytes per token (kv.footprint, stage "one_pool"): KV-shared layers
        hold none. Sliding layers are counted in full here; `window_group` gives their share,
        which the simulator puts in a window pool as the engine does."""
        if self.kv_layers is None:
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize
        return round(kv_bytes_per_token(self.kv_layers, itemsize, "one_pool", self.kv_context))

    def window_group(self, itemsize: int) -> tuple[int, int] | None:
        """(W, the sliding layers' bytes per token) when the engine keeps them in a window
        pool (kv.footprint.window_group_split), else None."""
        return None if self.kv_layers is None else window_group_split(self.kv_layers, itemsize)

    @classmethod
    def from_config(cls, cfg: dict[str, Any], name: str = "") -> ModelShape:
        heads = int(cfg["num_attention_heads"])
        mtype = cfg.get("model_type", "")
        bias = cfg.get("attention_bias", cfg.get("enable_bias", mtype in ("qwen2", "opt")))
        return cls(
            name=name or cfg.get("_name_or_path", "") or cfg.get("model_type", "model"),
            hidden_size=int(cfg["hidden_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            intermediate_size=int(cfg.get("intermediate_size") or cfg["ffn_dim"]),
            vocab_size=int(cfg["vocab_size"]),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(bias),
            mlp_matrices=2 if mtype in TWO_MATRIX_MLP else 3,
            kv_layers=tuple(layers_of_hf(cfg)) if mtype == "gemma4_text" else None,
        )


TWO_MATRIX_MLP = {"opt", "gpt2", "gpt_neox", "gptj", "bloom"}  # model_types with fc1/fc2 MLPs


# config.json fields of public models (Meta's and Qwen's published configs; no weights)
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama3-8b": {"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 32,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
                  "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
                  "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "llama3-70b": {"model_type": "llama", "hidden_size": 8192, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8, "intermediate_size": 28672,
                   "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0,
                   "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen2.5-32b": {"model_type": "qwen2", "hidden_size": 5120, "num_hidden_layers": 64,
                    "num_attention_heads": 40, "num_key_value_heads": 8, "intermediate_size": 27648,
                    "vocab_size": 152064, "max_position_embeddings": 32768, "rope_theta": 1000000.0,
                    "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    # facebook/opt-13b and opt-66b config.json (DistServe's models; OPT ties lm_head)
    "opt-13b": {"model_type": "opt", "hidden_size": 5120, "num_hidden_layers": 40,
                "num_attention_heads": 40, "ffn_dim": 20480, "vocab_size": 50272,
                "max_position_embeddings": 2048, "enable_bias": True,
                "tie_word_embeddings": True, "torch_dtype": "float16"},
    "opt-66b": {"model_type": "opt", "hidden_size": 9216, "num_hidden_layers": 64,
                "num_attention_heads": 72, "ffn_dim": 36864, "vocab_size": 50272,
                "max_position_embeddings": 2048, "enable_bias": True,
                "tie_word_embeddings": True, "torch_dtype": "float16"},
}  # fmt: skip


def load_model_config(spec: str) -> ModelShape:
    """A built-in name (llama3-8b, llama3-70b, qwen2.5-32b, opt-13b, opt-66b), a config.json,
    or a directory."""
    if spec.lower() in BUILTIN_CONFIGS:
        return ModelShape.from_config(BUILTIN_CONFIGS[spec.lower()], spec.lower())
    shipped = MODEL_CONFIG_DIR / f"{spec.lower()}.json"  # published configs (README there)
    if shipped.is_file():
        return ModelShape.from_config(json.loads(shipped.read_text()), spec.lower())
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        known = sorted(BUILTIN_CONFIGS) + sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.json"))
        raise ValueError(f"unknown model config {spec!r}: {known} or a path")
    return ModelShape.from_config(json.loads(path.read_text()), path.parent.name)


QUANT_KV = ("fp8", "fp8_e4m3", "int8")


def kv_bytes_per_token_of(shape: ModelShape, kv_dtype: str, block_size: int = 16) -> int:
    """KV bytes per token in `kv_dtype`; a quantized one adds its per-block scales (as
    pdserve.kv.quant stores them: 4 bytes per block, K/V and kv head), rounded up."""
    base = shape.kv_bytes_per_token(itemsize_of(kv_dtype))
    if kv_dtype.lower() not in QUANT_KV:
        return base
    return base + -(-2 * shape.num_layers * shape.num_kv_heads * 4 // block_size)


def itemsize_of(dtype: str) -> int:
    return {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2,
            "fp8": 1, "fp8_e4m3": 1, "int8": 1}.get(dtype.lower(), 2)  # fmt: skip


@dataclass(frozen=True)
class RooflineStep:
    """Step cost of `model` on `tp` x `hw` (tensor parallel; its all-reduces not modelled)."""

    model: ModelShape
    hw: Accelerator
    itemsize: int = 2
    tp: int = 1
    compute_eff: float = DEFAULT_EFFICIENCY["compute"]
    memory_eff: float = DEFAULT_EFFICIENCY["memory"]
    step_overhead_s: float = DEFAULT_EFFICIENCY["step_overhead_s"]
    kv_bytes: int = 0  # KV bytes per token (0 = the weights' itemsize)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.kv_bytes or self.model.kv_bytes_per_token(self.itemsize)

    @property
    def peak_flops(self) -> float:
        tflops = (
            self.hw.fp8_tflops if self.itemsize == 1 and self.hw.fp8_tflops else self.hw.bf16_tflops
        )
        return tflops * 1e12 * self.tp

    def step_s(self, batch: Sequence[tuple[int, int]]) -> float:
        if not batch:
            return 0.0
        return self.features_s(plan_features(batch))

    def features_s(self, features: tuple[float, float, float, float, float]) -> float:
        """A non-empty step from its `plan_features`."""
        _, new, _, ctx, pairs = features
        m = self.model
        flops = 2.0 * m.matmul_params * new + 4.0 * m.num_layers * m.num_heads * m.head_dim * pairs
        nbytes = m.matmul_params * self.itemsize + ctx * self.kv_bytes_per_token
        t_c = flops / (self.peak_flops * self.compute_eff)
        t_m = nbytes / (self.hw.mem_bw_TBps * 1e12 * self.tp * self.memory_eff)
        return self.step_overhead_s + max(t_c, t_m)

    def kv_capacity_bytes(self, mem_fraction: float = 0.9) -> int:
        total = self.hw.mem_GB * 1e9 * self.tp * mem_fraction
        return max(0, int(total - self.model.params * self.itemsize))


def parse_hardware(spec: str) -> tuple[Accelerator, int]:
    """'h100' | 'h100x2' (tensor parallel 2) -> (accelerator, tp)."""
    name, _, tp = spec.lower().partition("x")
    if name not in ACCELERATORS:
        raise ValueError(f"unknown hardware {spec!r}; known: {sorted(ACCELERATORS)} (NAMExTP)")
    return ACCELERATORS[name], int(tp or 1)


def roofline_costs(
    model: ModelShape | str,
    hardware: str,
    network: str = "nvlink",
    dtype: str = "bfloat16",
    efficiency: dict[str, float] | None = None,
    kv_dtype: str | None = None,
) -> CostModel:
    """`dtype`: the weights'; `kv_dtype`: the KV cache's (None = the weights')."""
    shape = load_model_config(model) if isinstance(model, str) else model
    hw, tp = parse_hardware(hardware)
    eff = DEFAULT_EFFICIENCY | (efficiency or {})
    kv_bytes = kv_bytes_per_token_of(shape, kv_dtype or dtype)
    step = RooflineStep(shape, hw, itemsize_of(dtype), tp, eff["compute"], eff["memory"],
                        eff["step_overhead_s"], kv_bytes)  # fmt: skip
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
) -> dict[str, CostModel]:
    """Per-role costs; 'h100' for every pool, or 'PREFILL_HW,DECODE_HW' (heterogeneous:
    colocated instances use the first)."""
    parts = [p.strip() for p in hardware.split(",") if p.strip()]
    pre, dec = parts[0], parts[-1]
    p = roofline_costs(model, pre, network, dtype, efficiency, kv_dtype)
    d = p if dec == pre else roofline_costs(model, dec, network, dtype, efficiency, kv_dtype)
    return {"prefill": p, "decode": d, "colocated": p}  # fmt: skip


def calibrate(profile: dict[str, Any], peak_flops: float, mem_bw_Bps: float) -> dict[str, float]:
    """Efficiency factors of a real profile against its machine's limits: the compute
    efficiency from a 512-token prefill step, the memory efficiency from a 16 x 512-context
    decode step (both from the fitted step model, overhead excluded)."""
    from pdserve.sim.costs import StepCost

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
    return {
        "compute": min(1.0, flops / pre / peak_flops) if pre > 0 else math.nan,
        "memory": min(1.0, nbytes / dec / mem_bw_Bps) if dec > 0 else math.nan,
        "step_overhead_s": st.base_s,
    }


def with_efficiency(step: RooflineStep, eff: dict[str, float]) -> RooflineStep:
    return replace(step, compute_eff=eff["compute"], memory_eff=eff["memory"])
