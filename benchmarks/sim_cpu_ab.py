"""CPU time of one `plan` simulation, two source trees alternated (A/B in one run).

The simulation is the documented plan search's costliest kind of point: its colocated
full-scale walk (16 llama3-8b H100 instances, chunk 2048, 256 sequences, 30 s of the Azure
conversation trace at 261.8 req/s, ~7,900 requests, ~1.9 M decode tokens). Each arm runs in a
fresh process with PYTHONPATH set to its `src` tree; the prompts' block hashes are memoised
before the clock starts, as in `plan`'s workers (a process replays the same prompts at many
rates). Every run prints a digest of its outcome (every request's token times, and every
instance's final KV state: free queue order, prefix cache map, ref counts, hit statistics):
both arms must print the same one.

    git archive <base commit> src | tar -x -C /tmp/base
    python -m benchmarks.sim_cpu_ab --a /tmp/base/src --b src --repeats 3 \
        --trace azure_llm_2023_conv.csv

`--case` adds variants that exercise other paths (a small KV pool forces preemptions;
nochunk: prefill priority; disagg: a 1P:1D unit), for the digest comparison.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

CASES = {  # name: (rate, replicas, flags)
    "full": (261.8, 16, ""),
    "preempt": (20.0, 1, "blocks=3000"),
    "preempt-nochunk": (20.0, 1, "blocks=3000,nochunk"),
    "preempt-disagg": (20.0, 1, "blocks=2500,disagg"),
}


def _one(rate: float, replicas: int, flags: set[str], trace: str) -> dict:
    """One simulation in this process (the arm's code is whatever `pdserve` imports)."""
    from pdserve.cli.plan import add_parser
    from pdserve.costmodel.shapes import load_model_config
    from pdserve.sim import run as simrun
    from pdserve.sim.candidates import Budget, candidates
    from pdserve.sim.instance import SimInstance
    from pdserve.workload.goodput import SLO

    ap = argparse.ArgumentParser()
    add_parser(ap.add_subparsers())
    args = ap.parse_args(["plan", "--model-config", "llama3-8b", "--trace", trace, "--slo",
                          "ttft:250", "tpot:100", "--duration", "30"])  # fmt: skip
    shape = load_model_config(args.model_config)
    args.vocab_size = shape.vocab_size
    cands = candidates(Budget.parse("h100:16"), "llama3-8b", "nvlink", "bfloat16", [2048], [256], 5)
    kind = "disagg" if "disagg" in flags else "colocated"
    cand = next(c for c in cands if c.kind == kind and c.n_prefill == 1 and c.n_decode <= 1)
    spec = cand.spec(replicas, shape.max_position_embeddings, args.block_size)
    for f in flags:
        for p in spec.pools:
            if f.startswith("blocks="):
                p.config.num_blocks = int(f.split("=")[1])
            if f == "nochunk":
                p.config.chunked_prefill = False
    warm = SimInstance("w", 3, spec.pools[0].costs, spec.pools[0].config)
    for r in simrun.sim_workload(args, rate):
        warm._prompt_hashes(r.prompt_ids)  # as in a plan worker: memoised per process
    made = []
    orig = simrun.SimCluster
    simrun.SimCluster = lambda *a, **k: made.append(orig(*a, **k)) or made[-1]
    c0 = time.process_time()
    run = simrun.simulate_once(spec, args, rate, SLO.parse(args.goodput), keep_records=False)
    cpu = time.process_time() - c0
    recs = [(r.index, r.finish_s, r.n_out, r.cached_tokens, r.error, r.token_times)
            for r in run["_records"]]  # fmt: skip
    pools = [(list(i.kv._pool._free), sorted(i.kv._pool._hash_to_block.items()),
              i.kv._pool.ref_counts, vars(i.kv._pool.stats)) for i in made[-1].instances.values()]  # fmt: skip
    digest = hashlib.sha256(json.dumps(recs).encode() + repr(pools).encode()).hexdigest()[:16]
    return {"cpu_s": cpu, "digest": digest, "preemptions": run["sim"]["preemptions"],
            "requests": len(recs)}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--a", required=True, help="arm A's src directory (the baseline)")
    ap.add_argument("--b", required=True, help="arm B's src directory")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--case", default="full", help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("--trace", required=True, help="the Azure conversation trace CSV")
    ap.add_argument("--_child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._child:
        rate, reps, flags = a._child
        out = _one(float(rate), int(reps), set(filter(None, flags.split(","))), a.trace)
        print(json.dumps(out))
        return 0
    ok = True
    for case in a.case.split(","):
        rate, reps, flags = CASES[case]
        cpu: dict[str, list[float]] = {"A": [], "B": []}
        digests: set[str] = set()
        for i in range(a.repeats):
            for arm, src in (("A", a.a), ("B", a.b)):  # alternated: both see the same load
                env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
                cmd = [sys.executable, __file__, "--a", a.a, "--b", a.b, "--trace", a.trace,
                       "--_child", str(rate), str(reps), flags or ","]  # fmt: skip
                res = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True,
                                                text=True).stdout.strip().splitlines()[-1])  # fmt: skip
                cpu[arm].append(res["cpu_s"])
                digests.add(res["digest"])
                load = os.getloadavg()[0]
                print(f"{case} #{i + 1} {arm}: {res['cpu_s']:.2f} s CPU, load {load:.1f}, "
                      f"{res['requests']} requests, {res['preemptions']} preemptions, "
                      f"digest {res['digest']}", flush=True)  # fmt: skip
        ma, mb = statistics.mean(cpu["A"]), statistics.mean(cpu["B"])
        ratios = [b / x for x, b in zip(cpu["A"], cpu["B"], strict=True)]
        print(f"{case}: A {ma:.2f} s (min {min(cpu['A']):.2f}, max {max(cpu['A']):.2f}), "
              f"B {mb:.2f} s (min {min(cpu['B']):.2f}, max {max(cpu['B']):.2f}); "
              f"B/A {mb / ma:.3f} (pairs {min(ratios):.3f}-{max(ratios):.3f}); "
              f"{'same outcome' if len(digests) == 1 else 'OUTCOMES DIFFER'}")  # fmt: skip
        ok &= len(digests) == 1
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
