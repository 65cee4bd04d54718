"""`plan_check`'s configurations: every candidate unit of `plan` replicated to fill the
device budget (what `plan` would deploy had it picked that unit), as a simulated
`ClusterSpec` and as the `pdserve up` flags of the same cluster, emulated.

The flags carry the engine shape the simulated spec has: the chunk / step token budget
(`--max-num-batched-tokens`), the batch cap (`--max-num-seqs`), the KV blocks of the
modelled device, least-loaded placement and no kvstore (`plan` simulates none). One
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
    up: list[str]  # `pdserve up` flags (without the --emulate ones)
    unit_goodput: float  # plan's unit goodput (req/s), x replicas = a start rate


def config_name(cand: Candidate, replicas: int) -> str:
    if cand.kind != "disagg":
        return f"{cand.n_prefill * replicas} colocated"
    p, d = cand.n_prefill * replicas, cand.n_decode * replicas
    name = f"{p}P{d}D"
    return name if replicas == 1 else f"{name} ({replicas} x {cand.n_prefill}P{cand.n_decode}D)"


def up_flags(spec: ClusterSpec) -> list[str]:
    """`pdserve up` flags of a simulated spec (one engine shape for every pool)."""
    pools = {p.role: p for p in spec.pools}
    shapes = {(p.config.max_num_batched_tokens, p.config.max_num_seqs, p.config.num_blocks,
               p.config.chunked_prefill) for p in spec.pools}  # fmt: skip
    if len(shapes) != 1:
        # the decode cap differs from the prefill pool's 256, or the KV blocks per role
        raise ValueError(f"pools with different engine shapes, not one --worker-arg set: {shapes}")
    chunk, seqs, blocks, chunked = shapes.pop()
    if "colocated" in pools:
        flags = ["--mode", "colocated", "--colocated", str(pools["colocated"].count)]
    else:
        flags = ["--mode", "disagg", "--prefill", str(pools["prefill"].count),
                 "--decode", str(pools["decode"].count)]  # fmt: skip
    flags += ["--policy", spec.policy, "--no-kvstore",
              f"--worker-arg=--max-num-batched-tokens={chunk}",
              f"--worker-arg=--max-num-seqs={seqs}", f"--worker-arg=--num-blocks={blocks}"]  # fmt: skip
    if not chunked:
        flags.append("--worker-arg=--no-chunked-prefill")
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
        out.append(Config(config_name(cand, replicas), cand.label, replicas,
                          cand.num_devices * replicas, spec, up_flags(spec),
                          u["goodput_req_s"]))  # fmt: skip
    return out


def pick_of(plan_result: dict[str, Any], configs: list[Config]) -> Config:
    """The configuration `plan` deploys: its best overall unit x its replicas."""
    best = plan_result["best_overall"]
    for c in configs:
        if c.unit == best["unit"] and c.replicas == best["replicas"]:
            return c
    raise ValueError(f"plan's pick {best['unit']} x{best['replicas']} is not a configuration")
