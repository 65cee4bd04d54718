"""KV bytes per token of a model by stage (naive, one_pool, cache, transfer, store), from
`pdserve.kv.footprint`, the one formula the engine, the simulator and the benchmarks share.

    python -m benchmarks.kv_footprint gemma4-31b --context 4096
    python -m benchmarks.kv_footprint /path/to/checkpoint --context 512 --dtype float32
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pdserve.costmodel.shapes import MODEL_CONFIG_DIR, layers_of_hf
from pdserve.kv.footprint import report


def main(argv: list[str] | None = None) -> int:
    """MODEL is a checkpoint directory, a config.json, or a name under
    pdserve/costmodel/model_configs; prints a markdown table of KV bytes per token by stage."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.kv_footprint")
    ap.add_argument("model")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args(argv)
    path = Path(args.model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        path = MODEL_CONFIG_DIR / f"{args.model}.json"
    layers = layers_of_hf(json.loads(path.read_text()))
    itemsize = 4 if args.dtype == "float32" else 2
    rows = report(layers, itemsize, args.context, args.block_size)
    print(f"{args.model} ({args.dtype}, {args.context}-token context, block {args.block_size})")
    print("| stage | KV bytes / token | vs naive |\n|---|---:|---:|")
    for stage, r in rows.items():
        print(f"| {stage} | {r['bytes_per_token']:,.0f} | {r['vs_naive']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
