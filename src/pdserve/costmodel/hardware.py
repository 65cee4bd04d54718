"""Accelerators and networks beyond this machine: vendor peak FLOP/s, memory bandwidth and
memory per part, and the links that carry KV between pools. Data only."""

from __future__ import annotations

from dataclasses import dataclass


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


def split_hardware(spec: str) -> tuple[str, int]:
    """'h100' -> ('h100', 1); 'h100x2' -> ('h100', 2); 'mi300x' -> ('mi300x', 1)."""
    spec = spec.lower().strip()
    name, sep, tp = spec.rpartition("x")
    if sep and name and tp.isdigit():
        return name, int(tp)
    return spec, 1


def parse_hardware(spec: str) -> tuple[Accelerator, int]:
    """'h100' | 'h100x2' (tensor parallel 2) -> (accelerator, tp)."""
    name, tp = split_hardware(spec)
    if name not in ACCELERATORS or tp < 1:
        raise ValueError(f"unknown hardware {spec!r}; known: {sorted(ACCELERATORS)} (NAMExTP)")
    return ACCELERATORS[name], tp
