"""What `pdserve plan` searches over: the device budget, the candidate units (colocated or
M prefill : N decode, with their engine caps and cost models), and one full-scale run of a
candidate replicated (`latency_at`)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pdserve.costmodel.costs import CostModel
from pdserve.costmodel.hardware import split_hardware
from pdserve.costmodel.roofline import roofline_costs
from pdserve.sim.cluster import ClusterSpec, PoolSpec
from pdserve.sim.instance import InstanceConfig
from pdserve.sim.run import instance_kv_config, simulate_once
from pdserve.workload.goodput import SLO

NOCHUNK = "colocated-nochunk"


KINDS = ("colocated", NOCHUNK, "disagg")


@dataclass(frozen=True)
class Budget:
    devices: dict[str, int]  # device type ('h100') -> devices available
    prices: dict[str, float] = field(default_factory=dict)  # $ per device-hour
    # device type -> the instance spec to plan with ('h100x2': tensor parallel 2; 'h100x4/8':
    # instances of TP 4 and of TP 8, each pool either); default: the type
    specs: dict[str, str] = field(default_factory=dict)

    def instance_specs(self) -> list[str]:
        out = []
        for hw in self.devices:
            name, tps = split_tps(self.specs.get(hw, hw))
            out += [f"{name}x{t}" for t in tps] if tps else [name]
        return out

    @classmethod
    def parse(cls, spec: str, prices: str | None = None) -> Budget:
        """'h100:16', 'h100:8,l40s:8' (heterogeneous: each pool tries each type),
        'a100x2:8' (8 A100s, instances of 2 in tensor parallel) or 'h100x4/8:32' (instances
        of TP 4 and of TP 8, tried per pool); prices 'h100=2.5,l40s=0.9' per device-hour."""
        devices, specs = {}, {}
        for part in spec.split(","):
            name, _, count = part.strip().partition(":")
            base, tps = split_tps(name.lower())
            bad = not name or not count.isdigit() or int(count) < 1
            if bad or ("/" in name and not tps) or any(int(t) < 1 for t in tps):
                raise ValueError(f"bad --hardware {spec!r}: NAME[xTP[/TP]]:COUNT[,NAME[xTP]:COUNT]")
            if base in devices:
                raise ValueError(f"bad --hardware {spec!r}: {base} given twice")
            devices[base], specs[base] = int(count), name.lower()
        pr = {}
        for part in (prices or "").split(","):
            if part.strip():
                name, _, val = part.partition("=")
                pr[name.strip().lower()] = float(val)
        return cls(devices, pr, specs)


def split_tps(spec: str) -> tuple[str, list[str]]:
    """'h100' -> ('h100', []); 'h100x2' -> ('h100', ['2']); 'h100x4/8' -> ('h100', ['4',
    '8']); 'mi300x' -> ('mi300x', []) (`hardware.split_hardware`, with TP alternatives)."""
    base, sep, tps = spec.rpartition("x")
    parts = tps.split("/")
    if sep and base and all(t.isdigit() for t in parts):
        return base, parts
    return spec, []


@dataclass
class Candidate:
    kind: str  # colocated | colocated-nochunk (vLLM <= 0.3 scheduler) | disagg
    hw_prefill: str
    hw_decode: str
    n_prefill: int  # colocated: instances
    n_decode: int
    chunk: int  # max_num_batched_tokens of prefill/colocated engines
    decode_seqs: int  # max_num_seqs of decode/colocated engines
    costs: dict[str, CostModel]

    @property
    def label(self) -> str:
        if self.kind == "colocated":
            return f"colocated {self.n_prefill}x{self.hw_prefill} chunk={self.chunk} seqs={self.decode_seqs}"
        if self.kind == NOCHUNK:
            return f"colocated {self.n_prefill}x{self.hw_prefill} no-chunk budget={self.chunk} seqs={self.decode_seqs}"
        hw = (
            self.hw_prefill
            if self.hw_prefill == self.hw_decode
            else f"{self.hw_prefill}/{self.hw_decode}"
        )
        return f"disagg {self.n_prefill}P:{self.n_decode}D {hw} chunk={self.chunk} seqs={self.decode_seqs}"

    def devices(self) -> dict[str, int]:
        out: dict[str, int] = {}
        pre = self.costs["prefill"].devices
        dec = self.costs["decode"].devices
        base_p = split_hardware(self.hw_prefill)[0]
        base_d = split_hardware(self.hw_decode)[0]
        if self.kind != "disagg":
            out[base_p] = self.n_prefill * pre
            return out
        out[base_p] = out.get(base_p, 0) + self.n_prefill * pre
        out[base_d] = out.get(base_d, 0) + self.n_decode * dec
        return out

    @property
    def num_devices(self) -> int:
        return sum(self.devices().values())

    def spec(self, replicas: int, max_model_len: int, block_size: int = 16) -> ClusterSpec:
        def cfg(role: str, seqs: int) -> InstanceConfig:
            pools = instance_kv_config(self.costs[role], block_size, max_model_len, seqs,
                                       self.costs[role].kv_capacity_bytes,
                                       max_num_batched_tokens=self.chunk,
                                       chunked_prefill=self.kind != NOCHUNK)  # fmt: skip
            return InstanceConfig(**pools, block_size=block_size,
                                  max_num_batched_tokens=self.chunk, max_num_seqs=seqs,
                                  max_model_len=max_model_len,
                                  chunked_prefill=self.kind != NOCHUNK)  # fmt: skip

        if self.kind != "disagg":
            pools = [PoolSpec("colocated", self.n_prefill * replicas, self.costs["colocated"],
                              cfg("colocated", self.decode_seqs))]  # fmt: skip
        else:
            pools = [
                PoolSpec("prefill", self.n_prefill * replicas, self.costs["prefill"],
                         cfg("prefill", 256)),
                PoolSpec("decode", self.n_decode * replicas, self.costs["decode"],
                         cfg("decode", self.decode_seqs)),
            ]  # fmt: skip
        return ClusterSpec(pools=pools, policy="least_loaded", session_affinity=False)


def candidates(
    budget: Budget,
    model: str,
    network: str,
    dtype: str,
    chunks: Sequence[int] = (2048, 8192),
    decode_seqs: Sequence[int] = (128, 256),
    max_unit: int = 8,
    colocated_modes: str = "chunked",
    kv_dtype: str | None = None,
    nochunk_budgets: Sequence[int] | None = None,
    disagg_chunks: Sequence[int] | None = None,
) -> list[Candidate]:
    """Colocated and disaggregated units over the budget's hardware. `colocated_modes`:
    'chunked' (this engine's scheduler), 'nochunk' (vLLM <= 0.3: prefill priority, whole
    prompts), or both, comma-separated. `kv_dtype`: the KV cache's (None = the weights').
    `nochunk_budgets` / `disagg_chunks`: the token budgets of the no-chunking colocated units
    and of the prefill pools (default: `chunks`)."""
    modes = {m.strip() for m in colocated_modes.split(",") if m.strip()}
    if not modes or modes - {"chunked", "nochunk"}:
        raise ValueError(f"bad colocated modes {colocated_modes!r}: chunked, nochunk or both")
    hws = budget.instance_specs()
    costs = {hw: roofline_costs(model, hw, network, dtype, None, kv_dtype) for hw in hws}
    out: list[Candidate] = []
    budgets = {"colocated": chunks, NOCHUNK: nochunk_budgets or chunks}
    for kind in [k for k, m in (("colocated", "chunked"), (NOCHUNK, "nochunk")) if m in modes]:
        for hw in hws:
            for chunk in budgets[kind]:
                for seqs in decode_seqs:
                    c = {"prefill": costs[hw], "decode": costs[hw], "colocated": costs[hw]}
                    out.append(Candidate(kind, hw, hw, 1, 0, chunk, seqs, c))
    for hp in hws:
        for hd in hws:
            for m in range(1, max_unit):
                for n in range(1, max_unit - m + 1):
                    if math.gcd(m, n) != 1:
                        continue
                    for chunk in disagg_chunks or chunks:
                        for seqs in decode_seqs:
                            c = {"prefill": costs[hp], "decode": costs[hd], "colocated": costs[hp]}
                            cand = Candidate("disagg", hp, hd, m, n, chunk, seqs, c)
                            if all(
                                budget.devices.get(k, 0) >= v for k, v in cand.devices().items()
                            ):
                                out.append(cand)
    return out


def latency_at(cand: Candidate, replicas: int, args: argparse.Namespace, slo: SLO,
               max_model_len: int, rate: float,
               early_stop_target: float | None = None) -> dict[str, Any]:  # fmt: skip
    """A full-scale run at `rate`. With `early_stop_target` a run that cannot reach it stops
    as soon as that is known (its attainment and latencies are then those of a partial run;
    a run that reaches the target is never stopped)."""
    spec = cand.spec(replicas, max_model_len, args.block_size)
    run = simulate_once(spec, args, rate, slo, early_stop_target=early_stop_target,
                        keep_records=False)  # fmt: skip
    s = run["summary"]
    return {
        "rate": rate,
        "attainment": run["attainment_ttft_tpot"],
        "ttft_p50_ms": s["ttft_ms"]["p50"], "ttft_p90_ms": s["ttft_ms"]["p90"],
        "tpot_p50_ms": s["tpot_ms"]["p50"], "tpot_p90_ms": s["tpot_ms"]["p90"],
        "completed": s["completed"], "num_requests": s["num_requests"],
    }  # fmt: skip
