"""The arms, as clusters of our simulator charged with DistServe's coefficients, and the
per-GPU goodput search both simulators' attainment curves go through."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from benchmarks.distserve_repro.workload import Workload
from pdserve.costmodel.costs import CostModel
from pdserve.costmodel.distserve import distserve_costs
from pdserve.sim.cluster import SimCluster
from pdserve.sim.run import spec_from_up_flags
from pdserve.workload.goodput import SLO, attainment
from pdserve.workload.requests import BenchRequest, random_tokens

TTFT_MS, TPOT_MS, TARGET = 250.0, 100.0, 0.9  # the paper's chatbot SLOs (OPT-13B), 90 %
MAX_MODEL_LEN = 2048  # OPT
VOCAB = 50272
STEP = 0.05  # per-GPU rate grid (req/s)


@dataclass(frozen=True)
class Arm:
    name: str
    what: str
    mode: str  # colocated | disagg
    engine: str  # whose coefficients: distserve | vllm
    tp_prefill: int = 1  # the colocated instance's TP when colocated
    tp_decode: int = 1
    chunk: int = 0  # 0: no chunking (prefill priority, whole prompts); else the token budget
    network: str | None = None  # KV link prefill -> decode (None: free, as DistServe's simulator)
    reproduced: bool = True  # run by DistServe's simulator too
    n_decode: int = 1  # decode instances (disagg)

    @property
    def gpus(self) -> int:
        return self.tp_prefill + (self.n_decode * self.tp_decode if self.mode == "disagg" else 0)

    def costs(self, coefficients: str) -> dict[str, CostModel]:
        pre = distserve_costs(coefficients, self.engine, self.tp_prefill, self.network)
        dec = distserve_costs(coefficients, self.engine, self.tp_decode, self.network)
        return {"prefill": pre, "decode": dec, "colocated": pre}

    def flags(self, coefficients: str) -> list[str]:
        """`pdserve up` flags of the arm: one instance per role, DistServe's batch limits (a
        prefill batch of up to its KV tokens, every running sequence in a decode step)."""
        budget = self.chunk or max(c.kv_capacity_bytes // c.kv_bytes_per_token
                                   for c in self.costs(coefficients).values())  # fmt: skip
        shape = ["--mode", self.mode, "--policy", "least_loaded", "--no-kvstore",
                 f"--worker-arg=--max-num-batched-tokens={budget}",
                 "--worker-arg=--max-num-seqs=4096", "--worker-arg=--no-enable-prefix-caching"]  # fmt: skip
        if not self.chunk:
            shape.append("--worker-arg=--no-chunked-prefill")
        if self.mode == "colocated":
            return [*shape, "--colocated", "1"]
        return [*shape, "--prefill", "1", "--decode", str(self.n_decode)]


ARMS = (
    Arm("distserve-2p-tp2-1d", "DistServe: prefill TP2 + decode TP1 (3 GPUs), its coefficients",
        "disagg", "distserve", tp_prefill=2),
    Arm("vllm-tp1", "vLLM TP1, no chunking, the vLLM baseline's slower coefficients",
        "colocated", "vllm"),
    Arm("colocated-tp1", "the same TP1 without chunking, DistServe's coefficients",
        "colocated", "distserve"),
)  # fmt: skip
EXTENSIONS = (
    Arm("colocated-tp1-chunk512", "TP1 with chunked prefill (512-token budget), DistServe's",
        "colocated", "distserve", chunk=512, reproduced=False),
    Arm("colocated-tp1-chunk2048", "TP1 with chunked prefill (2,048-token budget), DistServe's",
        "colocated", "distserve", chunk=2048, reproduced=False),
    Arm("distserve-2p-tp2-1d-nvlink3", "the DistServe arm with KV moved over NVLink 3",
        "disagg", "distserve", tp_prefill=2, network="nvlink3", reproduced=False),
    Arm("distserve-2p-tp2-1d-pcie4", "the DistServe arm with KV moved over PCIe Gen4 x16",
        "disagg", "distserve", tp_prefill=2, network="pcie4", reproduced=False),
    Arm("disagg-1p-1d", "prefill TP1 + decode TP1 (2 GPUs), DistServe's coefficients",
        "disagg", "distserve", reproduced=False),
    Arm("disagg-1p-2d", "prefill TP1 + 2 decodes TP1 (3 GPUs), DistServe's coefficients",
        "disagg", "distserve", reproduced=False, n_decode=2),
)  # fmt: skip


def requests(w: Workload, rate: float) -> list[BenchRequest]:
    """The workload at `rate` (cluster req/s): output_len + 1 tokens each, so that the
    decode steps after the prefill are DistServe's output_len."""
    rng = np.random.default_rng(w.seed)
    return [BenchRequest(i, random_tokens(rng, n_in, VOCAB), n_out + 1, arrival_s=t)
            for i, ((n_in, n_out), t) in enumerate(zip(w.pairs, w.arrivals(rate), strict=True))]  # fmt: skip


def our_attainment(arm: Arm, w: Workload, per_gpu_rate: float, coefficients: str) -> float:
    """Joint TTFT+TPOT attainment of `arm` in our simulator at `per_gpu_rate`."""
    spec = spec_from_up_flags(arm.flags(coefficients), arm.costs(coefficients), MAX_MODEL_LEN)
    records = SimCluster(spec).run(requests(w, per_gpu_rate * arm.gpus))
    return attainment(records, SLO(ttft_ms=TTFT_MS, tpot_ms=TPOT_MS))


def goodput(
    curve: Callable[[float], float], step: float = STEP, limit: float = 6.4
) -> tuple[float, dict[float, float]]:
    """Per-GPU goodput from attainment(rate) on the grid k x `step`: double k from 1 until a
    rate fails (attainment below TARGET), bisect down to neighbouring grid rates k_lo (passes,
    or rate 0) and k_lo + 1 (fails), and interpolate linearly to TARGET between them
    (attainment is taken to fall with the rate). Returns the goodput and every rate visited."""
    seen: dict[float, float] = {}

    def att(k: int) -> float:
        r = round(k * step, 6)
        if r not in seen:
            seen[r] = curve(r)
        return seen[r]

    k_max = round(limit / step)
    lo, hi = 0, 1
    while hi <= k_max and att(hi) >= TARGET:
        lo, hi = hi, (min(2 * hi, k_max) if hi < k_max else k_max + 1)
    if hi > k_max:
        return lo * step, seen
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if att(mid) >= TARGET else (lo, mid)
    a_lo = att(lo) if lo else 1.0
    a_hi = att(hi)
    return (lo + (a_lo - TARGET) / (a_lo - a_hi)) * step, seen
