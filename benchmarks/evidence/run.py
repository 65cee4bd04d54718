"""Evidence for the router's defaults, in simulation: each length-aware policy against its
baseline on real prompts and lengths, several seeds, paired differences with 95 % CIs.

    python -m benchmarks.evidence --groups sjf,placement,headroom,prefix,flip,tau \
        --seeds 5 --out bench-results/evidence.json

Clusters: Llama-3-8B shapes on H100 (roofline costs), 4P4D over NVLink and 8 colocated; the
length-routing group's decodes are H100s and L40Ss (`--emulate prefill=h100,decode=h100+l40s`).
Workloads (by path, never copied): the length data (real Arena prompts as text, the answer
lengths of every model), the Azure conversation trace, the Mooncake conversation trace (with
the kvstore), and a shift from Mooncake's long prompts and short answers to long answers.
For each arm and seed: goodput (SLO attainment x the offered rate: requests/s meeting both
SLOs over the arrival window), mean and p99 E2E. A gain is the
paired per-seed difference against the baseline arm (same requests, same arrivals), as a
percentage of the baseline's mean; the CI is Student's t over seeds (`stats.py`).

`--emulate [--time-scale X]`: every arm and seed also runs on a fresh emulated cluster
(`pdserve up <arm> --emulate h100 --model-config llama3-8b --time-scale X`, `emulated.py`)
with the same requests as its simulated twin; each row gets an `emulated` block of the same
statistics and `--table` prints simulation and emulation side by side. Text prompts then run
as the emulated tokenizer's ids on both sides (not len(text) / 4), so prompt lengths match.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.evidence.emulated import (
    EmuOptions,
    emulated_arm,
    requests_digest,
    tokenize_prompts,
    tokenizer_dir,
)
from benchmarks.evidence.metrics import arm_metrics
from benchmarks.evidence.stats import ci, merge, setup_rows, table
from pdserve.costmodel.roofline import pool_costs
from pdserve.router.scheduling.predictor import LengthEstimate, OutputLengthPredictor
from pdserve.router.scheduling.predictor.stats import kendall_tau
from pdserve.sim.cluster import SimCluster
from pdserve.sim.run import spec_from_up_flags, text_prompt_ids
from pdserve.sim.validate import flag_value
from pdserve.workload.goodput import SLO
from pdserve.workload.spec import add_workload_args, workload_at

DATA = "/work/shared/data"
LENGTHS = f"{DATA}/lengths/arena_train_val.jsonl.gz"
AZURE = f"{DATA}/traces/azure_llm_2023_conv.csv"
MOONCAKE = f"{DATA}/traces/mooncake_conversation_trace.jsonl"
MAX_LEN = 8192

D44 = ["--mode", "disagg", "--prefill", "4", "--decode", "4"]
C8 = ["--mode", "colocated", "--colocated", "8"]
LEN = (
    "--no-predictor-use-max-tokens"  # max_tokens is the true length: the predictor must not see it
)


LENGTH_SCALE = [1.0]  # --length-scale: the length data's answer lengths x this


def workload(kind: str, seed: int, n: int, window: bool = True) -> argparse.Namespace:
    """`window`: a trace workload's seed s replays the trace's s-th window of n requests
    (seed 1 = the first n); without it every seed replays the first window."""
    p = argparse.ArgumentParser()
    add_workload_args(p)
    flags = {
        "lengths": ["--lengths", LENGTHS, "--lengths-model", "any", "--lengths-split", "",
                    "--max-prompt-chars", "6000", "--length-scale", str(LENGTH_SCALE[0])],
        "azure": ["--trace", AZURE],
        "mooncake": ["--trace", MOONCAKE, "--block-size", "16"],
        # fits a 2,400-token KV pool: prompts <= 1,000 tokens, answers <= 1,100
        "lengths-2k": ["--lengths", LENGTHS, "--lengths-model", "any", "--lengths-split", "",
                       "--max-prompt-chars", "4000", "--length-scale", str(LENGTH_SCALE[0])],
    }[kind]  # fmt: skip
    if kind in ("mooncake", "azure") and window:
        flags += ["--trace-offset", str(max(0, seed - 1) * n)]
    max_len = 2200 if kind == "lengths-2k" else MAX_LEN
    a = p.parse_args([*flags, "--seed", str(seed), "--num-requests", str(n),
                      "--vocab-size", "128256", "--max-model-len", str(max_len)])  # fmt: skip
    return a


def requests_for(
    kind: str, seed: int, n: int, rate: float, tokenizer: str | None = None, window: bool = True
) -> list[Any]:
    """The requests of one seed. `tokenizer`: text prompts get that tokenizer's ids (the
    emulated cluster's; see emulated.py), else len(text) / 4 pseudo-random ids."""
    if kind == "shift":  # prefill-heavy (Mooncake: long prompts, short answers), then decode-heavy
        # the first window for every seed (the seed varies the second half)
        first = requests_for("mooncake", seed, n // 2, rate, tokenizer, window=False)
        second = requests_for("lengths", seed, n - n // 2, rate, tokenizer)
        t0 = max(r.arrival_s for r in first)
        return [replace(r, index=i, arrival_s=(r.arrival_s if i < len(first) else t0 + r.arrival_s))
                for i, r in enumerate(first + second)]  # fmt: skip
    reqs = workload_at(workload(kind, seed, n, window), rate, 0)
    if tokenizer:
        tokenize_prompts(reqs, tokenizer, 2200 if kind == "lengths-2k" else MAX_LEN)
    return text_prompt_ids(reqs, 128256)


class NoisyOracle(OutputLengthPredictor):
    """The true length x exp(N(0, sigma)): a predictor of chosen quality (the tau sweep)."""

    name = "noisy-oracle"

    def __init__(self, sigma: float, seed: int) -> None:
        import random

        self.sigma, self.rng = sigma, random.Random(seed)
        self.pairs: list[tuple[float, float]] = []

    def estimate(self, query):  # type: ignore[no-untyped-def]
        n = float(query.oracle_tokens or 1)
        p = n * math.exp(self.rng.gauss(0.0, self.sigma)) if self.sigma > 0 else n
        self.pairs.append((p, n))
        return LengthEstimate(p, p * 2.0, "noisy")


class RandomRank(OutputLengthPredictor):
    """A prediction that says nothing of the length: uniform on 1..1e6, seeded."""

    name = "random-rank"

    def __init__(self, seed: int) -> None:
        import random

        self.rng = random.Random(seed)

    def estimate(self, query):  # type: ignore[no-untyped-def]
        p = float(self.rng.randint(1, 10**6))
        return LengthEstimate(p, p, "random")


def _brief(run: dict[str, Any]) -> dict[str, Any]:
    """A run without its per-request timeline (for the log)."""
    return {k: v for k, v in run.items() if k != "timeline"}


def run_arm(
    up: list[str], reqs: list[Any], slo: SLO, predictor: OutputLengthPredictor | None = None
) -> dict[str, Any]:
    # the hardware the arm's pools emulate (`--emulate prefill=h100,decode=h100+l40s`), else H100
    costs = pool_costs("llama3-8b", flag_value(up, "--emulate") or "h100", "nvlink", "bfloat16")
    spec = spec_from_up_flags(up, costs, MAX_LEN)
    cluster = SimCluster(spec, predictor=predictor)
    records = cluster.run([replace(r) for r in reqs])
    tau = None
    if cluster.length is not None and hasattr(cluster.length.predictor, "running_tau"):
        tau = cluster.length.predictor.running_tau()
    return arm_metrics(records, reqs, slo) | {
        "preemptions": sum(i.scheduler.num_preemptions for i in cluster.instances.values()),
        "flips": len(cluster.flips),
        "tau": tau,
    }


# (group, workload, cluster flags, rate, n, SLO, arms {name: router flags}, baseline)
KV = ["--worker-arg=--num-blocks=150"]  # 2.4k tokens of KV per decode: KV binds
Q = "--queue-max-running-per-decode=8"  # binds: the natural concurrency is ~15 per decode
SJF_ARMS = {
    "no queue": [LEN],
    "fcfs": [LEN, Q, "--queue-order=fcfs"],
    "sjf online": [LEN, Q, "--queue-order=sjf"],
    "sjf oracle": [LEN, Q, "--queue-order=sjf", "--predictor-oracle"],
}
PLACE = {"count": [LEN], "predicted": [LEN, "--decode-placement=predicted"]}
# 4 H100 prefills, decodes alternately H100 (26,674 KV blocks) and L40S (13,125): long answers
# (predicted >= 256 tokens) to the H100s
MIXED = ["--emulate", "prefill=h100,decode=h100+l40s"]
D4M = ["--mode", "disagg", "--prefill", "4", "--decode", "4", *MIXED]
D2M = ["--mode", "disagg", "--prefill", "2", "--decode", "2", *MIXED]  # sized to emulate
LENGTH_ARMS = {
    "count": [LEN, "--decode-placement=count"],
    "length": [LEN, "--decode-placement=length"],
    "length oracle": [LEN, "--decode-placement=length", "--predictor-oracle"],
    # the same split by the KV share, the lengths ranked at random: what the
    # split alone buys (a predictor the router does not have: simulated only)
    "length random rank": [LEN, "--decode-placement=length", "--predictor-oracle"],
}
# arm -> the predictor it simulates with, per seed (such arms are not emulated)
SIM_PREDICTORS: dict[str, Callable[[int], OutputLengthPredictor]] = {
    "length random rank": lambda seed: RandomRank(seed)
}
SETUPS: list[tuple[str, str, str, list[str], float, int, str, dict[str, list[str]], str]] = [
    ("sjf", "lengths", "4P4D", D44, 40.0, 300, "ttft:2000 tpot:60", SJF_ARMS, "fcfs"),
    ("sjf", "lengths", "8 colocated", C8, 40.0, 300, "ttft:2000 tpot:60", SJF_ARMS, "fcfs"),
    ("placement", "lengths", "4P4D", D44, 80.0, 300, "ttft:2000 tpot:60", PLACE, "count"),
    ("placement", "lengths-2k", "4P4D KV-binds", D44 + KV, 40.0, 300, "ttft:2000 tpot:60", PLACE,
     "count"),
    ("headroom", "lengths-2k", "4P4D KV-binds", D44 + KV, 40.0, 300, "ttft:2000 tpot:60", {
        "off": [LEN], "reserve 512": [LEN, "--reserve-max-tokens=512"]}, "off"),
    ("headroom", "azure", "4P4D", D44, 60.0, 600, "ttft:1000 tpot:60", {
        "off": [LEN], "reserve 512": [LEN, "--reserve-max-tokens=512"]}, "off"),
    # rates where the SLOs bind (attainment 0.5-0.95 in simulation, seeds 1-3)
    ("prefix", "mooncake", "4P4D + kvstore", [*D44, "--kvstore"], 32.0, 300, "ttft:3000 tpot:60", {
        "least_loaded": ["--policy=least_loaded"], "prefix_aware": ["--policy=prefix_aware"]},
        "least_loaded"),
    # no kvstore, a 1,500-request window (the trace's next turns come minutes later): only
    # the instances' own prefix caches serve a repeated prefix
    ("prefix", "mooncake", "4P4D", D44, 28.0, 1500, "ttft:3000 tpot:60", {
        "least_loaded": ["--policy=least_loaded"], "prefix_aware": ["--policy=prefix_aware"]},
        "least_loaded"),
    ("prefix", "mooncake", "8 colocated + kvstore", [*C8, "--kvstore"], 90.0, 300,
        "ttft:3000 tpot:60", {
        "least_loaded": ["--policy=least_loaded"], "prefix_aware": ["--policy=prefix_aware"]},
        "least_loaded"),
    # 600 Mooncake requests then 600 `lengths` ones (~17 s each at 36/s): long enough for a
    # flip to pay back, at a rate where static 4P4D misses the TTFT SLO in the first phase
    # decode placement by predicted length on a decode pool of mixed memory (H100 + L40S)
    ("length", "lengths", "4P 2+2D mixed", D4M, 40.0, 300, "ttft:2000 tpot:60", LENGTH_ARMS,
     "count"),
    ("length", "azure", "4P 2+2D mixed", D4M, 60.0, 600, "ttft:1000 tpot:60", LENGTH_ARMS,
     "count"),
    ("length", "mooncake", "4P 2+2D mixed", D4M, 24.0, 300, "ttft:3000 tpot:60", LENGTH_ARMS,
     "count"),
    # half the cluster at half the rate: small enough for an emulated run of every seed
    ("length", "azure", "2P 1+1D mixed", D2M, 30.0, 150, "ttft:1000 tpot:60", LENGTH_ARMS,
     "count"),
    ("length", "mooncake", "2P 1+1D mixed", D2M, 12.0, 100, "ttft:3000 tpot:60", LENGTH_ARMS,
     "count"),
    ("flip", "shift", "4P4D", D44, 36.0, 1200, "ttft:3000 tpot:60", {
        "static": [LEN], "flip": [LEN, "--flip-enabled", "--flip-cooldown-s=5",
                                  "--flip-interval-s=1"]}, "static"),
]  # fmt: skip


def arm_up(cluster: list[str], flags: list[str]) -> list[str]:
    """`pdserve up` flags of an arm: the cluster's, `--policy P`, the rest as router flags."""
    up = cluster + [f"--router-arg={f}" for f in flags if not f.startswith("--policy")]
    for f in flags:
        if f.startswith("--policy"):
            up += ["--policy", f.split("=", 1)[1]]
    return up


SimRunner = Callable[[list[str], list[Any], SLO], dict[str, Any]]
EmuRunner = Callable[[list[str], list[Any], SLO, str], dict[str, Any]]


def run_setup(  # type: ignore[no-untyped-def]
    setup,
    seeds: list[int],
    log,
    emulate: EmuRunner | None = None,
    tokenizer: str | None = None,
    sim: SimRunner = run_arm,
    save: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every arm of `setup` for each seed, simulated and (with `emulate`) emulated, on one
    request list per seed. Each run records its seed and the digest of the requests it ran
    (taken after it ran); `setup_rows` refuses to pair runs whose digests differ. `save` is
    called with the result so far after every seed (a long emulated setup can be cut)."""
    group, kind, cname, cluster, rate, n, slo_s, arms, base = setup
    slo = SLO.parse(slo_s.split())
    meta = {"group": group, "workload": kind, "cluster": cname, "rate": rate, "n": n,
            "slo": slo_s}  # fmt: skip
    per_arm: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
    emu_arm: dict[str, list[dict[str, Any]]] | None = (
        {a: [] for a in arms if a not in SIM_PREDICTORS} if emulate else None
    )
    result: dict[str, Any] = {}
    for seed in seeds:
        reqs = requests_for(kind, seed, n, rate, tokenizer)
        for arm, flags in arms.items():
            up = arm_up(cluster, flags)
            t = time.perf_counter()
            if arm in SIM_PREDICTORS:
                run = run_arm(up, reqs, slo, predictor=SIM_PREDICTORS[arm](seed))
            else:
                run = sim(up, reqs, slo)
            run |= {"seed": seed, "requests": requests_digest(reqs)}
            per_arm[arm].append(run)
            log(f"{group}/{kind}/{cname} seed {seed} {arm}: {_brief(run)} "
                f"({time.perf_counter() - t:.0f} s)")  # fmt: skip
            if emulate is not None and emu_arm is not None and arm in emu_arm:
                name = f"{group}_{kind}_{cname}_s{seed}_{arm}".replace(" ", "-").replace("/", "-")
                erun = emulate(up, reqs, slo, name)
                erun |= {"seed": seed, "requests": requests_digest(reqs)}
                emu_arm[arm].append(erun)
                log(f"  emulated: {_brief(erun)}")
        result = {"rows": setup_rows(meta, base, per_arm, emu_arm), "runs": per_arm}
        if emu_arm is not None:
            result["emulated_runs"] = emu_arm
        if save is not None:
            save(result)
    return result


def tau_sweep(seeds: list[int], log, sigmas: list[float], n_override: int | None = None):  # type: ignore[no-untyped-def]
    """SJF's goodput and mean E2E with predictors of chosen quality (noisy oracle), against
    FCFS and the exact oracle: where does SJF close half of the FCFS -> oracle gap?"""
    setup = SETUPS[0]
    _, kind, _, cluster, rate, n, slo_s, arms, _ = setup
    n = n_override or n
    slo = SLO.parse(slo_s.split())
    out = []
    for sigma in sigmas:
        vals, taus = [], []
        for seed in seeds:
            reqs = requests_for(kind, seed, n, rate)
            pred = NoisyOracle(sigma, seed)
            up = cluster + [f"--router-arg={f}" for f in arms["sjf oracle"]]  # oracle_tokens on
            r = run_arm(up, reqs, slo, predictor=pred)
            p, a = zip(*pred.pairs, strict=True)
            taus.append(kendall_tau(p, a))
            vals.append(r)
        row = {"sigma": sigma, "tau": statistics.fmean(taus),
               "goodput": ci([v["goodput"] for v in vals]),
               "e2e_mean": ci([v["e2e_mean"] for v in vals])}  # fmt: skip
        log(f"tau sweep sigma {sigma}: {row}")
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--groups", default="sjf,placement,headroom,prefix,flip,length")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--seed-list", help="comma-separated seeds instead of 1..--seeds (one "
                   "emulated run split in parts; --merge joins them)")  # fmt: skip
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="join saved runs of different seeds into --out, then print the table",
    )
    p.add_argument("--only", help="comma-separated 'group/workload/cluster' names to run")
    p.add_argument("--arms", help="comma-separated arms to run (the baseline is always run)")
    p.add_argument("--n", type=int, help="requests per run (default: each setup's)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="answer lengths of the length data x this (CPU time)")  # fmt: skip
    p.add_argument("--sigmas", default="0,0.7,1.5", help="tau sweep: log-normal noise levels")
    p.add_argument("--emulate", action="store_true",
                   help="also run every arm and seed on a fresh emulated cluster (pdserve up "
                   "--emulate h100 --model-config llama3-8b) with the same requests")  # fmt: skip
    p.add_argument("--time-scale", type=float, default=10.0, help="--emulate: its time scale")
    p.add_argument("--tokenizer", help="--emulate: the emulated model's tokenizer directory "
                   "(default: the built-in tiny model's, as `pdserve up`)")  # fmt: skip
    p.add_argument("--out", default="bench-results/evidence.json")
    p.add_argument("--table", nargs="+", metavar="JSON", help="print the table of saved runs")
    a = p.parse_args(argv)
    if a.table:
        print(table(a.table))
        return 0
    if a.merge:
        Path(a.out).write_text(json.dumps(merge(a.merge), indent=1, default=str))
        print(table([a.out]))
        return 0
    seeds = ([int(x) for x in a.seed_list.split(",")] if a.seed_list
             else list(range(1, a.seeds + 1)))  # fmt: skip
    LENGTH_SCALE[0] = a.length_scale
    groups = a.groups.split(",")

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"seeds": seeds, "setups": [], "tau_sweep": None,
                              "argv": sys.argv[1:] if argv is None else argv}  # fmt: skip
    emulate, tokenizer = None, None
    if a.emulate:
        opt = EmuOptions(time_scale=a.time_scale, tokenizer=a.tokenizer,
                         log_dir=out.parent / f"{out.stem}_emu")  # fmt: skip
        tokenizer = tokenizer_dir(opt)
        result["emulate"] = {"time_scale": a.time_scale, "tokenizer": tokenizer}

        def emulate(up: list[str], reqs: list[Any], slo: SLO, name: str) -> dict[str, Any]:
            return emulated_arm(up, reqs, slo, opt, name)

    def write() -> None:
        out.write_text(json.dumps(result, indent=1, default=str))

    for setup in SETUPS:
        name = f"{setup[0]}/{setup[1]}/{setup[2]}"
        if setup[0] not in groups or (a.only and name not in a.only.split(",")):
            continue
        if a.n:
            setup = (*setup[:5], a.n, *setup[6:])
        if a.arms:
            keep = set(a.arms.split(",")) | {setup[8]}
            setup = (*setup[:7], {k: v for k, v in setup[7].items() if k in keep}, setup[8])
        result["setups"].append({})

        def save(r: dict[str, Any]) -> None:
            result["setups"][-1] = r
            write()

        run_setup(setup, seeds, log, emulate=emulate, tokenizer=tokenizer, save=save)
    if "tau" in groups:
        sigmas = [float(x) for x in a.sigmas.split(",")]
        result["tau_sweep"] = tau_sweep(seeds, log, sigmas, a.n)
        write()
    log(f"wrote {out}")
    return 0
