"""`python -m benchmarks.window_pool`: the decode batch that fits in a fixed number of KV bytes
with Gemma 4's sliding layers in their own pool (kv/window_group.py) vs one pool for every layer.

One process, one tiny Gemma 4 (fp32, made with `make_tiny`), the same requests (distinct random
prompts, greedy, `--output` tokens each, all queued at once) through in-process engines that get
the same `kv_cache_bytes`: the one-pool engine (`window_pool=False`, the layout before) and the
window-pool engine at each `--max-num-seqs` (the window pool is sized for that many windows,
the main pool gets the rest: `window_pool_sizes`). Reported per arm: the KV bytes allocated,
the blocks of each pool, the largest decode batch (sequences past their prompt in one step),
the mean batch over decode steps, preemptions, and the ratio of the largest batch to the
one-pool arm's. Tokens of every arm are asserted equal to the one-pool arm's.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any


def _run(loaded: Any, prompts: list[list[int]], output: int, **kw: Any) -> dict[str, Any]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.params import SamplingParams

    cfg = EngineConfig(model_dir=loaded.model_dir, dtype="float32", **kw)
    engine = LLMEngine(cfg, loaded=loaded)
    params = SamplingParams(max_tokens=output, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
        tokens[f"r{i}"] = []
    batches: list[int] = []
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        decoding = sum(1 for s in engine.scheduler.running if s.num_output_tokens > 0)
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
        if decoding:
            batches.append(decoding)
    engine.check_integrity()
    kv_bytes = sum(c.numel() * c.element_size() for c in engine.runner.kv_caches)
    return {
        "window_pool": engine.window is not None,
        "max_num_seqs": cfg.max_num_seqs,
        "kv_bytes_allocated": kv_bytes,
        "main_blocks": engine.num_blocks,
        "window_blocks": engine.num_window_blocks,
        "max_decode_batch": max(batches),
        "mean_decode_batch": sum(batches) / len(batches),
        "preemptions": engine.scheduler.num_preemptions,
        "seconds": time.perf_counter() - started,
        "tokens": [tokens[f"r{i}"] for i in range(len(prompts))],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.window_pool")
    ap.add_argument("--kv-bytes", type=int, default=8 << 20)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--max-num-seqs", default="32,64,96")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    from pdserve.model.loader import load_model
    from pdserve.model.tiny import TinySpec, make_tiny

    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(
            make_tiny(Path(tmp) / "g4", TinySpec(family="gemma4", vocab=512)), dtype="float32"
        )
        rng = random.Random(0)
        prompts = [
            [rng.randrange(7, 512) for _ in range(args.prompt)] for _ in range(args.requests)
        ]
        common = dict(
            kv_cache_bytes=args.kv_bytes,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )
        seqs = [int(x) for x in args.max_num_seqs.split(",")]
        base = _run(
            loaded, prompts, args.output, window_pool=False, max_num_seqs=max(seqs), **common
        )
        arms = [base] + [
            _run(loaded, prompts, args.output, window_pool=True, max_num_seqs=m, **common)
            for m in seqs
        ]
    for arm in arms[1:]:
        assert arm["tokens"] == base["tokens"], "greedy tokens differ from the one-pool engine"
    rows = []
    for arm in arms:
        arm = {k: v for k, v in arm.items() if k != "tokens"}
        arm["batch_vs_one_pool"] = arm["max_decode_batch"] / base["max_decode_batch"]
        rows.append(arm)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"tiny gemma4 fp32, {args.kv_bytes:,} KV bytes, {args.requests} requests x "
        f"({args.prompt} prompt + {args.output} output) tokens, block {args.block_size}; "
        "tokens equal in every arm"
    )
    print(
        "| layout | max_num_seqs | KV bytes | main blocks | window blocks | max decode batch "
        "| mean | preemptions | vs one pool |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        name = "window pool" if r["window_pool"] else "one pool"
        print(
            f"| {name} | {r['max_num_seqs']} | {r['kv_bytes_allocated']:,} | {r['main_blocks']} "
            f"| {r['window_blocks']} | {r['max_decode_batch']} | {r['mean_decode_batch']:.1f} "
            f"| {r['preemptions']} | {r['batch_vs_one_pool']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
