"""`plan_check`'s configurations: every candidate unit of `plan` replicated to fill the
device budget (what `plan` would deploy had it picked that unit), as a simulated
`ClusterSpec` and as the `pdserve up` flags of the same cluster, emulated.

The flags carry the engine shape the simulated spec has: the chunk / step token budget
(`--max-num-batched-tokens`), the batch cap (`--max-num-seqs`), the KV blocks of the
modelled device (each pool's own when their hardware differs), least-loaded placement, no
kvstore (`plan` simulates none) and each pool's hardware (`--emulate`). One
`--worker-arg` set serves every worker, so a disaggregated cluster's prefill workers get the
decode cap as well (`plan` gives them 256: identical with `--decode-seqs 256`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve.sim.cluster import ClusterSpec

if TYPE_CHECKING:
    from pdserve.sim.candidates import Budget, Candidate


@dataclass
class Config:
    name: str  # '4 colocated', '3P1D', '2P2D (2 x 1P1D)'
    unit: str  # plan's unit label
    replicas: int
    devices: int
    spec: ClusterSpec
    up: list[str]  # `pdserve up` flags, `--emulate HW` included (not the model, time scale)
    unit_goodput: float  # plan's unit goodput (req/s), x replicas = a start rate


def config_name(cand: Candidate, replicas: int, with_hardware: bool = False) -> str:
    """'4 colocated', '3P1D', '2P2D (2 x 1P1D)'; `with_hardware` (a budget of several
    types): '2 colocated h100', '1P1D h100/l40s' (prefill / decode)."""
    hw = ""
    if with_hardware:
        same = cand.kind != "disagg" or cand.hw_prefill == cand.hw_decode
        hw = f" {cand.hw_prefill}" if same else f" {cand.hw_prefill}/{cand.hw_decode}"
    if cand.kind != "disagg":
        return f"{cand.n_prefill * replicas} colocated{hw}"
    p, d = cand.n_prefill * replicas, cand.n_decode * replicas
    name = f"{p}P{d}D{hw}"
    return name if replicas == 1 else f"{name} ({replicas} x {cand.n_prefill}P{cand.n_decode}D)"


def hardware_of(cand: Candidate) -> str:
    """The `--emulate` spec of a candidate's pools (costmodel.pools)."""
    if cand.kind != "disagg" or cand.hw_prefill == cand.hw_decode:
        return cand.hw_prefill
    return f"prefill={cand.hw_prefill},decode={cand.hw_decode}"


def up_flags(spec: ClusterSpec, hardware: str | None = None) -> list[str]:
    """`pdserve up` flags of a simulated spec (one engine shape for every pool). With the
    `hardware` of its pools (`--emulate`), pools whose KV blocks differ (one per hardware
    type) size their KV from their hardware, as the simulated spec does; without it, one
    `--num-blocks` must serve every pool."""
    pools = {p.role: p for p in spec.pools}
    shapes = {(p.config.max_num_batched_tokens, p.config.max_num_seqs, p.config.chunked_prefill)
              for p in spec.pools}  # fmt: skip
    blocks = {p.config.num_blocks for p in spec.pools}
    if len(shapes) != 1 or (len(blocks) != 1 and hardware is None):
        # the decode cap differs from the prefill pool's 256, or the KV blocks per role
        raise ValueError(f"pools with different engine shapes, not one --worker-arg set: "
                         f"{shapes}, blocks {blocks}")  # fmt: skip
    chunk, seqs, chunked = shapes.pop()
    if "colocated" in pools:
        flags = ["--mode", "colocated", "--colocated", str(pools["colocated"].count)]
    else:
        flags = ["--mode", "disagg", "--prefill", str(pools["prefill"].count),
                 "--decode", str(pools["decode"].count)]  # fmt: skip
    flags += ["--policy", spec.policy, "--no-kvstore",
              f"--worker-arg=--max-num-batched-tokens={chunk}",
              f"--worker-arg=--max-num-seqs={seqs}"]  # fmt: skip
    if len(blocks) == 1:
        flags.append(f"--worker-arg=--num-blocks={blocks.pop()}")
    if not chunked:
        flags.append("--worker-arg=--no-chunked-prefill")
    if hardware is not None:
        flags += ["--emulate", hardware]
    return flags


def configurations(
    cands: list[Candidate], units: list[dict[str, Any]], budget: Budget, max_model_len: int,
    block_size: int = 16,
) -> list[Config]:  # fmt: skip
    """One full-scale configuration per candidate unit that `plan` searched (`units`:
    `plan(...)["units"]`, matched by label), in plan's order."""
    by_label = {u["label"]: u for u in units}
    out: list[Config] = []
    for cand in cands:
        u = by_label.get(cand.label)
        if u is None:
            continue
        unit = cand.devices()
        replicas = min(budget.devices[hw] // n for hw, n in unit.items())
        if replicas < 1:
            continue
        spec = cand.spec(replicas, max_model_len, block_size)
        name = config_name(cand, replicas, len(budget.devices) > 1)
        out.append(Config(name, cand.label, replicas,
                          cand.num_devices * replicas, spec, up_flags(spec, hardware_of(cand)),
                          u["goodput_req_s"]))  # fmt: skip
    return out


def pick_of(plan_result: dict[str, Any], configs: list[Config]) -> Config:
    """The configuration `plan` deploys: its best overall unit x its replicas."""
    best = plan_result["best_overall"]
    for c in configs:
        if c.unit == best["unit"] and c.replicas == best["replicas"]:
            return c
    raise ValueError(f"plan's pick {best['unit']} x{best['replicas']} is not a configuration")
