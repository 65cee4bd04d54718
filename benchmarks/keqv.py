"""`python -m benchmarks.keqv`: the decode cost of Gemma 4's one-tensor K = V cache.

A K = V layer's cache keeps V only and rebuilds K = rope(k_norm.weight * V) over the gathered
context on every read (model/gemma4_keqv.py). Baseline: the same model serving those layers from
an ordinary K + V cache through the attention backend (`store_k_and_v` below). Both arms
run the same greedy decode (asserted equal), interleaved, in one process; the reported figure
is the ratio of decode step times (median over repeats, with the min-max range), and the KV
bytes each arm holds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pdserve.model.attention import AttentionMetadata, select_backend
from pdserve.model.loader import load_model
from pdserve.model.tiny import TinySpec, make_tiny


def _caches(loaded, num_blocks: int, bs: int, keqv: bool) -> list[torch.Tensor]:
    return [
        torch.zeros((num_blocks, 1 if (keqv and kv.k_eq_v) else 2, bs, kv.num_kv_heads,
                     kv.head_dim), dtype=loaded.dtype)
        for kv in loaded.config.kv_layers()
    ]  # fmt: skip


def _decode(loaded, caches, prompts, steps: int, bs: int) -> tuple[list[list[int]], list[float]]:
    """Prefill every prompt (one step), then `steps` batched greedy decode steps; returns the
    tokens and each decode step's seconds."""
    n = len(prompts[0]) + steps + 1
    per = -(-n // bs)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
    model, out, times = loaded.model, [[] for _ in prompts], []
    with torch.inference_mode():
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.tensor([j for p in prompts for j in range(len(p))])
        lens = [len(p) for p in prompts]
        meta = AttentionMetadata.build(lens, lens, tables, bs)
        h = model(ids, pos, caches, meta)
        last = torch.tensor(lens).cumsum(0) - 1
        tok = model.compute_logits(h[last]).argmax(-1)
        for _ in range(steps):
            for i, t in enumerate(tok.tolist()):
                out[i].append(t)
            pos = torch.tensor(lens)
            lens = [x + 1 for x in lens]
            meta = AttentionMetadata.build([1] * len(lens), lens, tables, bs)
            t0 = time.perf_counter()
            h = model(tok, pos, caches, meta)
            tok = model.compute_logits(h).argmax(-1)
            times.append(time.perf_counter() - t0)
    return out, times


def store_k_and_v(model) -> None:  # type: ignore[no-untyped-def]
    """The baseline arm: serve a Gemma4Model's K = V layers from an ordinary K + V cache
    through the attention backend (caches then need 2 tensors on every stored layer). Same
    outputs, twice the bytes on those layers."""
    model.keqv = [False] * len(model.layers)
    for layer in model.layers:
        key = (layer.kv_heads, layer.head_dim)
        if key not in model.backends:
            be = select_backend(model.embed_tokens.weight.device, model.config.num_heads, *key)
            be.scale = 1.0
            model.backends[key] = be
    model.set_batch_invariant(model.batch_invariant)


def run(args: argparse.Namespace) -> dict:
    spec = TinySpec(family="gemma4", hidden=args.hidden, heads=4, kv_heads=2, head_dim=args.head_dim,
                    intermediate=2 * args.hidden, vocab=1024, max_pos=args.context + args.steps + 64,
                    layers=6, sliding_window=args.window)  # fmt: skip
    model_dir = make_tiny(Path(tempfile.mkdtemp(prefix="keqv-")) / "m", spec)
    bs, g = 16, torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(7, 1000, (args.context,), generator=g).tolist() for _ in range(args.batch)
    ]
    nb = 2 + args.batch * -(-(args.context + args.steps + 1) // bs)
    arms = {"v_only": load_model(model_dir), "k_and_v": load_model(model_dir)}
    store_k_and_v(arms["k_and_v"].model)
    med: dict[str, list[float]] = {a: [] for a in arms}
    tokens = {}
    for _ in range(args.repeats):
        for name, loaded in arms.items():
            caches = _caches(loaded, nb, bs, keqv=name == "v_only")
            toks, times = _decode(loaded, caches, prompts, args.steps, bs)
            tokens[name] = toks
            med[name].append(statistics.median(times))
    assert tokens["v_only"] == tokens["k_and_v"], "the two cache layouts decode differently"
    kv_bytes = {a: sum(c.numel() * c.element_size() for c in _caches(arms[a], nb, bs, a == "v_only"))
                for a in arms}  # fmt: skip
    ratios = [a / b for a, b in zip(med["v_only"], med["k_and_v"], strict=True)]
    return {
        "config": vars(args),
        "decode_step_ms": {a: [round(x * 1e3, 3) for x in v] for a, v in med.items()},
        "ratio_v_only_over_k_and_v": {"median": round(statistics.median(ratios), 3),
                                      "min": round(min(ratios), 3), "max": round(max(ratios), 3)},
        "kv_cache_bytes": kv_bytes,
    }  # fmt: skip


def attention_cost(args: argparse.Namespace) -> dict:
    """One K = V layer's decode attention alone (batch x context, heads 8 / kv heads 1 x
    2*head_dim, as a Gemma 4 full layer): V-only cache + K rebuilt on read vs the backend over a
    K + V cache. Min over repeats (robust to other processes on the machine), interleaved."""
    from pdserve.model.attention import select_backend
    from pdserve.model.gemma4 import rope_tables
    from pdserve.model.gemma4_config import RopeSpec
    from pdserve.model.gemma4_keqv import keqv_attention, plan_keqv

    bs, b, s, h, hkv, d = 16, args.batch, args.context, 8, 1, 2 * args.head_dim
    per = -(-(s + 1) // bs)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(b)]
    nb = 1 + b * per
    g = torch.Generator().manual_seed(0)
    one = torch.randn(nb, 1, bs, hkv, d, generator=g)
    two = torch.randn(nb, 2, bs, hkv, d, generator=g)
    q, k, v = (torch.randn(b, n, d, generator=g) for n in (h, hkv, hkv))
    w = torch.randn(d, generator=g)
    cos, sin = rope_tables(RopeSpec("proportional", 1e6, 0.25), d, s + 2, torch.device("cpu"),
                           torch.float32)  # fmt: skip
    meta = AttentionMetadata.build([1] * b, [s + 1] * b, tables, bs)
    be = select_backend("cpu", h, hkv, d)
    be.scale = 1.0
    times: dict[str, list[float]] = {"v_only": [], "k_and_v": []}
    with torch.inference_mode():
        for _ in range(args.repeats * 6):
            t0 = time.perf_counter()
            keqv_attention(plan_keqv(meta), q, k, v, one, w, cos, sin)
            times["v_only"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            be.forward(be.prepare(meta), q, k, v, two, None)
            times["k_and_v"].append(time.perf_counter() - t0)
    best = {a: min(t) * 1e3 for a, t in times.items()}
    return {
        "layer_attention_ms_min": {a: round(x, 3) for a, x in best.items()},
        "layer_attention_ms_median": {
            a: round(statistics.median(t) * 1e3, 3) for a, t in times.items()
        },
        "ratio_min": round(best["v_only"] / best["k_and_v"], 3),
        "shape": {"batch": b, "context": s, "heads": h, "kv_heads": hkv, "head_dim": d},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.keqv", description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: steadier on a busy box)"
    )
    ap.add_argument("--layer-only", action="store_true", help="time one layer's attention only")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(json.dumps(attention_cost(args) if args.layer_only else run(args), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
