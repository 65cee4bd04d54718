"""`pdserve plan`: how many prefill and decode instances (or colocated ones) for a workload,
SLOs, model and device budget, by simulation.

Search (DistServe's approach: find the best *unit*, then replicate it):
1. Candidates: colocated (one instance) and disaggregated units M:N (coprime, M + N <= 8
   instances), each with per-pool engine caps: the chunk size / token budget of prefill or
   colocated engines (`max_num_batched_tokens`) and the decode batch cap (`max_num_seqs`).
   With two hardware types, disaggregated units also try each type per pool (heterogeneous).
2. Each unit's goodput: the highest rate at which >= `target` of requests meet both TTFT and
   TPOT SLOs (`workload.goodput.search_goodput_rate`: bracket by doubling, then bisect), every
   point a full simulation of the workload window at that rate. Per-device goodput = that
   rate / the unit's devices.
3. The best unit of each kind is replicated to fill the budget (k units, k x the rate) and
   the replicated cluster is simulated at k x its unit goodput to check (reported as
   `full_scale_attainment`).
The searches run as one-point tasks on `--jobs` processes (`sim.plan_search`): the same
rates as running them one after the other (`unit_goodput`, the sequential reference).
Cost per million output tokens = price per device-hour x devices / (goodput x mean output
tokens x 3600) x 1e6.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

from pdserve.costmodel.shapes import load_model_config
from pdserve.router.flip.policy import FlipThresholds  # noqa: F401  (documented option)
from pdserve.sim import parallel
from pdserve.sim.candidates import KINDS, NOCHUNK, Budget, Candidate, candidates
from pdserve.sim.plan_search import PlanSearch, unit_summary
from pdserve.sim.run import base_for, simulate_once
from pdserve.workload.goodput import SLO, search_goodput_rate


def unit_goodput(
    cand: Candidate,
    args: argparse.Namespace,
    slo: SLO,
    max_model_len: int,
    target: float,
    start_rate: float,
) -> dict[str, Any]:
    spec = cand.spec(1, max_model_len, args.block_size)
    outputs: list[float] = []

    def measure(rate: float) -> float:
        run = simulate_once(spec, args, rate, slo, early_stop_target=target, keep_records=False)
        s = run["summary"]
        if s["completed"] and not run["sim"]["stopped_early"]:
            outputs.append(s["total_output_tokens"] / s["completed"])
        return run["attainment_ttft_tpot"] or 0.0

    points = search_goodput_rate(measure, start_rate, target, max_steps=10, bisect_steps=3)
    return unit_summary(cand, points, outputs, target)


def cost_per_m_tokens(devices: dict[str, int], prices: dict[str, float], rate: float,
                      out_tokens: float) -> float | None:  # fmt: skip
    if rate <= 0 or out_tokens <= 0 or not prices:
        return None
    if any(hw not in prices for hw in devices):
        return None
    per_hour = sum(prices[hw] * n for hw, n in devices.items())
    return per_hour / (rate * out_tokens * 3600.0) * 1e6


def cost_ranking(rows: list[dict[str, Any]], prices: dict[str, float]) -> list[dict[str, Any]]:
    """Configurations ranked by cost per goodput, cheapest first: $ per device-hour x devices
    over the goodput ($/h per req/s) and per million output tokens at that goodput. Rows
    (label, devices {type: n}, goodput_req_s, mean_output_tokens) without a price for each
    of their device types, or without goodput, rank last, by per-device goodput."""
    out = []
    for r in rows:
        per_hour = None
        if prices and all(hw in prices for hw in r["devices"]):
            per_hour = sum(prices[hw] * n for hw, n in r["devices"].items())
        rate = r["goodput_req_s"]
        out.append({
            "label": r["label"], "devices": r["devices"], "goodput_req_s": rate,
            "per_device_goodput": rate / max(1, sum(r["devices"].values())),
            "usd_per_hour": per_hour,
            "usd_per_hour_per_req_s": per_hour / rate if per_hour is not None and rate > 0
            else None,
            "cost_per_m_output_tokens": cost_per_m_tokens(r["devices"], prices, rate,
                                                          r["mean_output_tokens"]),
        })  # fmt: skip
    return sorted(out, key=lambda r: (r["usd_per_hour_per_req_s"] is None,
                                      r["usd_per_hour_per_req_s"] or 0.0,
                                      -r["per_device_goodput"]))  # fmt: skip


def plan(
    args: argparse.Namespace,
    budget: Budget,
    model: str,
    network: str = "nvlink",
    dtype: str = "bfloat16",
    target: float = 0.9,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    slo = SLO.parse(args.goodput)
    ts = slo.only("ttft", "tpot")
    if ts.ttft_ms is None or ts.tpot_ms is None:
        raise ValueError("plan needs both SLOs: --slo ttft:MS tpot:MS")
    shape = load_model_config(model)
    max_model_len = args.max_model_len or shape.max_position_embeddings
    chunks = [int(x) for x in args.chunks.split(",")]
    seqs = [int(x) for x in args.decode_seqs.split(",")]
    kv_dtype = getattr(args, "kv_dtype", None)
    cands = candidates(budget, model, network, dtype, chunks, seqs, args.max_unit,
                       colocated_modes=getattr(args, "colocated_modes", None) or "chunked",
                       kv_dtype=kv_dtype)  # fmt: skip
    jobs = getattr(args, "jobs", 1) or os.cpu_count() or 1
    log(f"{len(cands)} candidate units; simulating the rate searches ({jobs} processes) ...")
    base_for(args, 0)  # read the trace once, before the workers fork
    parallel.CONTEXT.update(args=args, slo=slo, max_model_len=max_model_len, target=target,
                            cands=cands)  # fmt: skip
    with parallel.Runner(jobs) as runner:
        search = PlanSearch(runner, cands, budget, args.start_rate, target, KINDS, log)
        search.run()
    results, walks = [r for r in search.units if r is not None], search.walks
    log(f"{runner.jobs} processes, {search.sched.submitted} simulations "
        f"({search.sched.wasted} speculative ones not needed)")  # fmt: skip
    best: dict[str, Any] = {}
    for kind, (top, replicas, unit_rate, walk) in walks.items():
        cand = top["candidate"]
        full_rate, check = parallel.walk_answer(unit_rate, walk)
        unit = cand.devices()
        devices = {hw: n * replicas for hw, n in unit.items()}
        best[kind] = {
            "unit": cand.label,
            "replicas": replicas,
            "instances": {"prefill": cand.n_prefill * replicas, "decode": cand.n_decode * replicas}
            if kind == "disagg" else {kind: cand.n_prefill * replicas},
            "devices": devices,
            "goodput_req_s": full_rate,
            "unit_goodput_x_replicas": unit_rate,
            "per_device_goodput": full_rate / sum(devices.values()),
            "unit_per_device_goodput": top["per_device_goodput"],
            "cost_per_m_output_tokens": cost_per_m_tokens(
                devices, budget.prices, full_rate, top["mean_output_tokens"]),
            "full_scale": check,
        }  # fmt: skip
    ratio = None
    if "colocated" in best and "disagg" in best and best["colocated"]["per_device_goodput"]:
        ratio = best["disagg"]["per_device_goodput"] / best["colocated"]["per_device_goodput"]
    unit_ratio = None
    if "colocated" in best and "disagg" in best and best["colocated"]["unit_per_device_goodput"]:
        unit_ratio = (
            best["disagg"]["unit_per_device_goodput"] / best["colocated"]["unit_per_device_goodput"]
        )
    nochunk_ratio = None
    if "disagg" in best and best.get(NOCHUNK, {}).get("per_device_goodput"):
        nochunk_ratio = best["disagg"]["per_device_goodput"] / best[NOCHUNK]["per_device_goodput"]
    overall = max(best.values(), key=lambda b: b["per_device_goodput"]) if best else None
    mean_out = {r["label"]: r["mean_output_tokens"] for r in results}
    ranking = cost_ranking(
        [{k: r[k] for k in ("label", "devices", "goodput_req_s", "mean_output_tokens")}
         for r in results]
        + [{"label": f"{b['unit']} x{b['replicas']}", "devices": b["devices"],
            "goodput_req_s": b["goodput_req_s"], "mean_output_tokens": mean_out[b["unit"]]}
           for b in best.values()], budget.prices)  # fmt: skip
    return {
        "model": shape.name,
        "dtype": dtype,
        "kv_dtype": kv_dtype or dtype,
        "network": network,
        "budget": budget.devices,
        "prices": budget.prices,
        "slo": slo.to_json(),
        "target": target,
        "units": [
            {k: v for k, v in r.items() if k != "candidate"}
            | {
                "cost_per_m_output_tokens": cost_per_m_tokens(
                    r["devices"], budget.prices, r["goodput_req_s"], r["mean_output_tokens"]
                )
            }
            for r in results
        ],
        "best": best,
        "best_overall": overall,
        "cost_ranking": ranking,
        "disagg_over_colocated_per_device": ratio,
        "disagg_over_colocated_per_device_units": unit_ratio,
        "disagg_over_colocated_nochunk_per_device": nochunk_ratio,
    }
