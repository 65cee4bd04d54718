"""The roofline against published GPU measurements: every point's modelled and published step
time, and the fit that src/pdserve/costmodel/fitted/calibration.json ships.

    python -m benchmarks.published_costs [--json] [--hardware h100,a100]
    python -m benchmarks.published_costs --fit             # refit: the calibration entries
    python -m benchmarks.published_costs --from-vidur DIR  # re-derive the stored tables

The published points (Llama-3-8B, bf16, one GPU) are assembled from Vidur's per-operator
timings; benchmarks/published/vidur_llama3_8b.json holds the numbers taken from its tables
(repository, commit, files, column) and this module derives each point from them:

- Linear operators, per step: 32 x the sum of the nine per-layer operators' medians
  (input_layernorm, attn_pre_proj, attn_rope, attn_post_proj, post_attention_layernorm,
  mlp_up_proj, mlp_act, mlp_down_proj, add) + the embedding, at num_tokens = the step's new
  tokens. A100: Vidur's Meta-Llama-3-8B table. H100: Vidur has no Llama-3-8B table for it, so
  its Llama-2-7B table converted per operator by the ratio of the operator's weights or
  elements (`CONVERT`): the fused QKV projection x 0.5 (8 KV heads instead of 32), the MLP
  operators x 14336 / 11008 (intermediate size), rope x 40 / 64 (query + key heads), the
  hidden-size operators x 1. The same conversion of the A100's Llama-2-7B table lands within
  7 % of its Llama-3-8B table (1-4 % from 128 tokens up). The H100 table stops at 4,096
  tokens: its 8,192-token prefill takes 2 x the 4,096 value (2,048 -> 4,096 scales 2.06x).
- Attention, per step: 32 x the attn_prefill (prompt of n tokens, nothing cached) or
  attn_decode (batch b, k cached tokens each) median of the A100 Llama-3-8B table; the mean
  where several rows were read. No table covers Llama-3-8B's attention on an H100: the A100
  rows are scaled by the datasheet ratios, peak FLOP/s (312 / 989.4) for prefill and bandwidth
  (2.039 / 3.35) for decode, i.e. the H100 is assumed to reach the A100's fraction of peak,
  which is what the same tables show for the linear operators (4,096 tokens: 3.13x faster,
  peak ratio 3.17; one token: 1.66x, bandwidth ratio 1.64). These H100 rows are estimates.
- Left out: kv_cache_save, which in the prefill rows costs 1.1 ms per layer for 2,048 tokens
  (8 MB of KV at 7.6 GB/s, nine times its per-token cost in the decode rows: an artifact of
  the profiled path, not a serving engine's KV write; 2-4 us per layer in decode rows); and
  the lm_head and sampling, which Vidur does not time. The modelled side leaves the lm_head
  out as well (RooflineStep(lm_head=False)).

A prefill point is the batch [(0, n)]; a decode point [(k, 1)] * b.

The fit (--fit), per accelerator: (1) `memory` from the slope of batch-1 layer time against
layer weight bytes over every model Vidur profiled on that GPU (`batch1_layer`); (2)
`attention_compute` from the A100 prefill attention rows of 2,048-8,192 tokens (relative
least squares; the H100 gets the same, its rows being scaled A100 rows); (3) `compute`,
`attention_memory` and `layer_overhead_s` by Nelder-Mead on the RMS relative error over the
accelerator's published points, (1) and (2) held.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.costmodel.calibration import calibration_entry, efficiency_for
from pdserve.costmodel.hardware import ACCELERATORS
from pdserve.costmodel.roofline import RooflineStep
from pdserve.costmodel.shapes import load_model_config

PUBLISHED = Path(__file__).parent / "published" / "vidur_llama3_8b.json"
OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")  # fmt: skip
CONVERT = {"attn_pre_proj": (4096 + 2 * 1024) / (4096 + 2 * 4096), "attn_rope": 40 / 64,
           "mlp_up_proj": 14336 / 11008, "mlp_act": 14336 / 11008,
           "mlp_down_proj": 14336 / 11008}  # fmt: skip
TABLES = {"h100": ("h100/meta-llama/Llama-2-7b-hf", CONVERT),
          "a100": ("a100/meta-llama/Meta-Llama-3-8B", {})}  # fmt: skip


@dataclass(frozen=True)
class Point:
    kind: str  # prefill | decode
    tokens: int  # prompt tokens (prefill) or batch (decode)
    context: int  # cached tokens per sequence (decode)
    published_ms: float
    note: str = ""

    @property
    def batch(self) -> list[tuple[int, int]]:
        return [(0, self.tokens)] if self.kind == "prefill" else [(self.context, 1)] * self.tokens

    @property
    def label(self) -> str:
        if self.kind == "prefill":
            return f"prefill {self.tokens}"
        return f"decode b{self.tokens} @{self.context}"


def load_published(path: Path = PUBLISHED) -> dict[str, Any]:
    return json.loads(path.read_text())


def published_points(pub: dict[str, Any], hw: str) -> list[Point]:
    """The accelerator's points, derived from the stored tables (module docstring)."""
    lin = {int(k): float(v) for k, v in pub["linear_ops_ms"][hw].items()}
    att = pub["a100_attention_ms_per_layer"]
    a100, dev = ACCELERATORS["a100"], ACCELERATORS[hw]
    scale_p = a100.bf16_tflops / dev.bf16_tflops
    scale_d = a100.mem_bw_TBps / dev.mem_bw_TBps
    layers = int(pub["layers"])
    out = []
    for n in pub["points"]["prefill"]:
        note = "" if hw == "a100" else "attention estimated from A100 rows"
        if n in lin:
            linear = lin[n]
        else:
            linear, note = 2 * lin[n // 2], note + "; linear operators 2 x those at n/2"
        attn = layers * float(np.mean(att["prefill"][str(n)])) * scale_p
        out.append(Point("prefill", n, 0, linear + attn, note.lstrip("; ")))
    for b, k in pub["points"]["decode"]:
        note = "" if hw == "a100" else "attention estimated from A100 rows"
        attn = layers * float(np.mean(att["decode"][f"{b}x{k}"])) * scale_d
        out.append(Point("decode", b, k, lin[b] + attn, note))
    return out


def model_step(hw: str, efficiency: dict[str, float] | None = None) -> RooflineStep:
    """The shipped RooflineStep for Llama-3-8B on `hw`, without the lm_head (as the data)."""
    return RooflineStep.build(load_model_config("llama3-8b"), hw, "bfloat16", efficiency,
                              lm_head=False)  # fmt: skip


def compare(hw: str, efficiency: dict[str, float] | None = None) -> dict[str, Any]:
    step = model_step(hw, efficiency)
    rows = []
    for p in published_points(load_published(), hw):
        ours = step.step_s(p.batch) * 1e3
        rows.append({"point": p.label, "kind": p.kind, "tokens": p.tokens, "context": p.context,
                     "published_ms": round(p.published_ms, 3), "ours_ms": round(ours, 3),
                     "rel_error": round((ours - p.published_ms) / p.published_ms, 4),
                     "note": p.note})  # fmt: skip
    return {"points": rows, "max_rel_error": max(abs(r["rel_error"]) for r in rows),
            "efficiency": efficiency_for(hw) | (efficiency or {}),
            "source": (calibration_entry(hw) or {}).get("source", "DEFAULT_EFFICIENCY")}  # fmt: skip


def _nelder_mead(f: Any, x0: list[float], iters: int = 600) -> np.ndarray:
    """Minimise f from x0 (deterministic; simplex of +10 % steps)."""
    n = len(x0)
    s = np.array([x0] + [np.array(x0) * (1 + 0.1 * np.eye(n)[i]) for i in range(n)], float)
    fs = np.array([f(x) for x in s])
    for _ in range(iters):
        o = np.argsort(fs, kind="stable")
        s, fs = s[o], fs[o]
        c = s[:-1].mean(axis=0)
        xr = c + (c - s[-1])
        fr = f(xr)
        if fr < fs[0]:
            xe = c + 2 * (c - s[-1])
            fe = f(xe)
            s[-1], fs[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < fs[-2]:
            s[-1], fs[-1] = xr, fr
        else:
            xc = c + 0.5 * (s[-1] - c)
            fc = f(xc)
            if fc < fs[-1]:
                s[-1], fs[-1] = xc, fc
            else:
                s[1:] = s[0] + 0.5 * (s[1:] - s[0])
                fs[1:] = [f(x) for x in s[1:]]
    return s[int(np.argmin(fs))]


def fit(hw: str, pub: dict[str, Any] | None = None) -> dict[str, float]:
    """The calibration of `hw` from the stored tables (module docstring, three steps)."""
    pub = pub or load_published()
    dev, a100 = ACCELERATORS[hw], ACCELERATORS["a100"]
    rows = np.array(list(pub["batch1_layer"][hw].values()), float)  # [bytes, ms]
    slope = np.polyfit(rows[:, 0], rows[:, 1], 1)[0]  # ms per byte
    memory = 1e3 / slope / (dev.mem_bw_TBps * 1e12)  # bytes / (s x bandwidth)
    shape = load_model_config("llama3-8b")
    per_pair = 4.0 * shape.num_heads * shape.head_dim  # attention FLOPs per layer per pair
    att = [(n, float(np.mean(v))) for n, v in pub["a100_attention_ms_per_layer"]["prefill"].items()]
    x = np.array(
        [
            per_pair * int(n) * (int(n) + 1) / 2 / (a100.bf16_tflops * 1e12) * 1e3
            for n, _ in att
            if int(n) >= 2048
        ]
    )  # fmt: skip  (ms at 100 % of peak)
    t = np.array([v for n, v in att if int(n) >= 2048])
    attention_compute = float(np.sum((x / t) ** 2) / np.sum(x / t))  # relative least squares
    points = published_points(pub, hw)
    base = {"memory": float(memory), "attention_compute": attention_compute,
            "step_overhead_s": 0.0}  # fmt: skip
    step0 = model_step(hw, base)

    def loss(q: np.ndarray) -> float:
        compute, attn_mem, layer_s = q
        if not (0.05 < compute <= 1 and 0.05 < attn_mem <= 1 and layer_s >= 0):
            return 1e9
        st = replace(step0, compute_eff=compute, attn_memory_eff=attn_mem,
                     layer_overhead_s=layer_s * 1e-3)  # fmt: skip
        e = [(st.step_s(p.batch) * 1e3 - p.published_ms) / p.published_ms for p in points]
        return float(np.sqrt(np.mean(np.square(e))))

    compute, attn_mem, layer_ms = _nelder_mead(loss, [0.6, 0.75, 0.03])
    return {"compute": round(float(compute), 4), "memory": round(float(memory), 4),
            "attention_compute": round(attention_compute, 4),
            "attention_memory": round(float(attn_mem), 4), "step_overhead_s": 0.0,
            "layer_overhead_s": round(float(layer_ms) * 1e-3, 8)}  # fmt: skip


def from_vidur(root: Path) -> dict[str, Any]:
    """`linear_ops_ms` and `batch1_layer` recomputed from a Vidur checkout's mlp.csv files."""
    compute = root / "data" / "profiling" / "compute"
    out: dict[str, Any] = {"linear_ops_ms": {}, "batch1_layer": {}}
    for hw, (table, conv) in TABLES.items():
        with open(compute / table / "mlp.csv") as f:
            rows = [r for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "1"]
        out["linear_ops_ms"][hw] = {
            r["num_tokens"]: round(32 * sum(float(r[f"time_stats.{o}.median"]) * conv.get(o, 1)
                                            for o in OPS) + float(r["time_stats.emb.median"]), 3)
            for r in rows if int(r["num_tokens"]) in (1, 8, 16, 32, 128, 512, 1024, 2048, 4096, 8192)
        }  # fmt: skip
        out["batch1_layer"][hw] = {}
        for path in sorted((compute / hw).glob("*/*/mlp.csv")):
            with open(path) as f:
                rs = [r for r in csv.DictReader(f) if r["num_tensor_parallel_workers"] == "1"]
            r = next(r for r in rs if r["num_tokens"] == "1")
            if any(f"time_stats.{o}.median" not in r for o in OPS):
                continue  # phi-2: no post_attention_layernorm
            h, nh, kvh = int(r["n_embd"]), int(r["n_head"]), int(r["n_kv_head"])
            mlp = (3 if r["use_gated_mlp"] == "True" else 2) * h * int(r["n_expanded_embd"])
            layer = h * (h + 2 * kvh * (h // nh)) + h * h + mlp
            t = round(sum(float(r[f"time_stats.{o}.median"]) for o in OPS), 4)
            out["batch1_layer"][hw][f"{path.parent.parent.name}/{path.parent.name}"] = [
                2 * layer,
                t,
            ]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hardware", default="h100,a100")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--fit", action="store_true", help="refit and print the efficiencies")
    ap.add_argument("--from-vidur", type=Path, help="a Vidur checkout: re-derive the tables")
    args = ap.parse_args(argv)
    hws = [h.strip() for h in args.hardware.split(",") if h.strip()]
    command = " ".join(
        ["python -m benchmarks.published_costs", *(argv if argv is not None else sys.argv[1:])]
    )
    if args.from_vidur:
        print(json.dumps({"command": command, **from_vidur(args.from_vidur)}, indent=1))
        return 0
    if args.fit:
        print(json.dumps({"command": command, **{hw: fit(hw) for hw in hws}}, indent=1))
        return 0
    res = {hw: compare(hw) for hw in hws}
    out = {"command": command, "hardware": res,
           "max_rel_error": max(r["max_rel_error"] for r in res.values())}  # fmt: skip
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    for hw, r in res.items():
        print(f"{hw}: {r['source']}")
        print(f"  {'point':<22}{'published ms':>14}{'ours ms':>10}{'error':>9}  note")
        for p in r["points"]:
            print(f"  {p['point']:<22}{p['published_ms']:>14.2f}{p['ours_ms']:>10.2f}"
                  f"{p['rel_error'] * 100:>+8.1f}%  {p['note']}")  # fmt: skip
        print(f"  max_rel_error {r['max_rel_error']:.3f}")
    print(f"max_rel_error {out['max_rel_error']:.3f}  ({command})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
