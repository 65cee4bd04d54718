"""`pdserve bench multiturn`: KV reuse across chat turns and the kvstore capacity curve.

Modes:
  --addr A                           concurrent chat sessions against a running router
  --compare-kvstore                  the same sessions on two fresh clusters (--kvstore and
                                     --no-kvstore), back to back; prints the ratios
  --trace T --capacity-curve C1,...  simulation (no cluster): hit rate of the kvstore's own
                                     BlockStore per capacity vs the unlimited best case; a
                                     capacity RAM+DISK (1GiB+16GiB) adds a disk tier
  --trace T --replay N --addr A      the first N trace requests against a real cluster
  --trace T --store-replay N         the first N requests' KV traffic against real kvstore
                                     processes, one per --store-capacities arm (storereplay.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from pathlib import Path
from typing import Any

from pdserve.bench.cachesim import parse_tiers, simulate
from pdserve.bench.cluster import UpProcess
from pdserve.bench.loadgen import open_client, run_load
from pdserve.bench.plots import plot_capacity_curve, plot_latency_cdfs
from pdserve.bench.report import latency_arrays, write_json
from pdserve.bench.sessions import SessionPlan, run_sessions, turn_report
from pdserve.dtypes import ITEMSIZE
from pdserve.kv.spec import QUANT_KV_DTYPES, KVSpec
from pdserve.workload import arrivals
from pdserve.workload.metrics import summarize
from pdserve.workload.requests import trace_requests
from pdserve.workload.traces import MOONCAKE_BLOCK_TOKENS, read_mooncake_jsonl

DEFAULT_KV_BYTES_PER_TOKEN = 8192  # bench50m: K,V x 8 layers x 2 kv heads x 64 dims x fp32


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("multiturn", help="multi-turn KV reuse benchmark / capacity curve")
    p.add_argument("--addr", default="127.0.0.1:50051")
    p.add_argument("--model", help="checkpoint dir (vocab, context, KV bytes per token)")
    p.add_argument("--vocab-size", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=256, help="turn-1 prompt tokens")
    p.add_argument("--user-len", type=int, default=64, help="new user tokens per later turn")
    p.add_argument("--output-len", type=int, default=32, help="answer tokens per turn")
    p.add_argument("--think-time", type=float, default=1.0, help="mean pause between turns (s)")
    p.add_argument("--ramp", type=float, default=2.0, help="session starts spread over (s)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-kvstore", action="store_true")
    p.add_argument(
        "--port",
        type=int,
        default=0,
        help="router port of --compare-kvstore clusters (0 = any free)",
    )
    p.add_argument("--up-args", default="", help="extra `pdserve up` flags (--compare-kvstore)")
    p.add_argument("--trace", help="Mooncake JSONL trace")
    p.add_argument(
        "--capacity-curve",
        help="e.g. 64MiB,256MiB,1GiB,1GiB+16GiB,unlimited (simulation; RAM+DISK = disk tier)",
    )
    p.add_argument(
        "--kv-bytes-per-token",
        type=int,
        help="KV bytes per token (default: from --model, else 8 KiB = bench50m fp32)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=[*sorted(ITEMSIZE), *QUANT_KV_DTYPES],
        help="the workers' KV dtype, for the KV bytes per token of --model (default: the "
        "checkpoint's torch_dtype; workers under --dtype auto serve bfloat16 on CPUs with "
        "AMX or AVX512-BF16 and on GPUs)",
    )
    p.add_argument("--length-scale", type=float, default=1.0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--replay", type=int, help="replay the first N trace requests on --addr")
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--store-replay", type=int, help="replay N requests on real kvstores")
    p.add_argument(
        "--store-capacities",
        default="16MiB,16MiB+256MiB",
        help="--store-replay arms: RAM or RAM+DISK each (a fresh store per arm)",
    )
    p.add_argument("--limit", type=int, help="read only the first N trace lines (simulation)")
    p.add_argument("--out", default="results/multiturn.json")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=main)


def _model_cfg(args: argparse.Namespace) -> dict[str, Any]:
    return json.loads((Path(args.model) / "config.json").read_text()) if args.model else {}


def kv_bytes_per_token(args: argparse.Namespace) -> int:
    if args.kv_bytes_per_token:
        return args.kv_bytes_per_token
    cfg = _model_cfg(args)
    if not cfg:
        return DEFAULT_KV_BYTES_PER_TOKEN
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads", heads)
    dtype = args.kv_dtype or str(cfg.get("torch_dtype", "float32"))
    if dtype not in ITEMSIZE and dtype not in QUANT_KV_DTYPES:
        dtype = "float32"
    spec = KVSpec(cfg["num_hidden_layers"], kv_heads, head_dim, args.block_size, dtype)
    return spec.bytes_per_block // args.block_size  # quantized: scales included


def capacity_curve(args: argparse.Namespace) -> dict[str, Any]:
    records = read_mooncake_jsonl(args.trace, args.limit)
    per_tok = kv_bytes_per_token(args)
    block_bytes = max(1, round(MOONCAKE_BLOCK_TOKENS * args.length_scale)) * per_tok
    specs = [s.strip() for s in args.capacity_curve.split(",") if s.strip()]
    caps = [parse_tiers(s) for s in specs]
    best = simulate(records, None, block_bytes)
    rows = []
    for spec, (cap, disk) in zip(specs, caps, strict=True):
        res = best if cap is None else simulate(records, cap, block_bytes, disk)
        rows.append(
            {
                "capacity": spec,
                "capacity_bytes": cap,
                "disk_bytes": disk,
                "capacity_blocks": res.capacity_blocks,
                "hit_rate": res.hit_rate,
                "of_best": res.hit_rate / best.hit_rate if best.hit_rate else None,
                "disk_share_of_hits": res.disk_hit_tokens / res.hit_tokens
                if res.hit_tokens
                else 0.0,
                "evictions": res.evictions,
            }
        )
    print(
        f"{len(records)} requests, block = {block_bytes / 2**20:.2f} MiB "
        f"({per_tok} B/token), best-case hit rate {best.hit_rate:.1%}"
    )
    print(f"{'capacity':>14}{'RAM blocks':>12}{'hit rate':>10}{'of best':>10}{'from disk':>11}")
    for r in rows:
        of_best = f"{r['of_best']:.1%}" if r["of_best"] is not None else "-"
        blocks = r["capacity_blocks"] if r["capacity_blocks"] is not None else "all"
        disk = f"{r['disk_share_of_hits']:.1%}" if r["disk_bytes"] else "-"
        print(f"{r['capacity']:>14}{blocks!s:>12}{r['hit_rate']:>10.1%}{of_best:>10}{disk:>11}")
    png = plot_capacity_curve(
        specs, [r["hit_rate"] for r in rows], best.hit_rate, Path(args.out).with_suffix(".png")
    )
    return {
        "mode": "capacity_curve",
        "block_bytes": block_bytes,
        "kv_bytes_per_token": per_tok,
        "best_hit_rate": best.hit_rate,
        "rows": rows,
        "plot": str(png),
    }


def _limits(args: argparse.Namespace) -> tuple[int, int | None]:
    cfg = _model_cfg(args)
    return (
        int(args.vocab_size or cfg.get("vocab_size") or 1000),
        args.max_model_len or cfg.get("max_position_embeddings"),
    )


def sessions_once(addr: str, args: argparse.Namespace) -> dict[str, Any]:
    vocab, max_len = _limits(args)
    plan = SessionPlan(
        args.sessions,
        args.turns,
        args.first_len,
        args.user_len,
        args.output_len,
        args.think_time,
        args.ramp,
        vocab,
        max_len,
        args.seed,
    )

    async def go() -> tuple[list, float]:
        async with open_client(addr) as client:
            return await run_sessions(client, plan, args.temperature, not args.no_progress)

    records, wall = asyncio.run(go())
    rep = turn_report(records)
    t2 = rep["turns2plus"]
    print(
        f"turns 2+: hit rate {t2['hit_rate']:.1%}, TTFT p50 {t2['ttft_ms']['p50']} ms, "
        f"p90 {t2['ttft_ms']['p90']} ms ({t2['turns']} turns, {t2['failed']} failed)"
    )
    return {
        "plan": plan.__dict__,
        "report": rep,
        "summary": summarize(records, wall),
        "records": [r.to_json() for r in records],
    }


def compare_kvstore(args: argparse.Namespace) -> dict[str, Any]:
    extra = shlex.split(args.up_args) + (["--model", args.model] if args.model else [])
    out = Path(args.out)
    arms: dict[str, dict[str, Any]] = {}
    for name, flag in (("kvstore", "--kvstore"), ("no-kvstore", "--no-kvstore")):
        print(f"== arm {name}", flush=True)
        with UpProcess(
            [flag, *extra], port=args.port, log_path=out.parent / f"{out.stem}_{name}_up.log"
        ) as addr:
            arms[name] = sessions_once(addr, args)
    a, b = (arms[n]["report"]["turns2plus"] for n in ("kvstore", "no-kvstore"))
    ratios = {
        "hit_rate": (a["hit_rate"], b["hit_rate"]),
        "ttft_p50_ms": (a["ttft_ms"]["p50"], b["ttft_ms"]["p50"]),
        "ttft_p90_ms": (a["ttft_ms"]["p90"], b["ttft_ms"]["p90"]),
    }
    table = {
        k: {"kvstore": x, "no-kvstore": y, "ratio": (x / y if x is not None and y else None)}
        for k, (x, y) in ratios.items()
    }
    print(f"{'turns 2+':<14}{'kvstore':>12}{'no-kvstore':>12}{'ratio':>8}")
    for k, row in table.items():
        cells = [f"{v:.3f}" if isinstance(v, float) else "-" for v in row.values()]
        print(f"{k:<14}{cells[0]:>12}{cells[1]:>12}{cells[2]:>8}")
    return {"mode": "compare_kvstore", "arms": arms, "ratio_kvstore_over_no_kvstore": table}


def replay(args: argparse.Namespace) -> dict[str, Any]:
    vocab, max_len = _limits(args)
    records = read_mooncake_jsonl(args.trace, args.replay)
    reqs = trace_requests(records, vocab, args.seed, args.length_scale, max_len, args.block_size)
    times = arrivals.replay_arrivals([r.arrival_s for r in reqs], args.time_scale)
    for r, t in zip(reqs, times, strict=True):
        r.arrival_s = t

    async def go() -> tuple[list, float]:
        async with open_client(args.addr) as client:
            return await run_load(
                client,
                reqs,
                temperature=args.temperature,
                progress=not args.no_progress,
                desc="replay",
            )

    recs, wall = asyncio.run(go())
    summary = summarize(recs, wall)
    best = simulate(records, None, 1).hit_rate
    print(
        f"replayed {len(recs)} requests: hit rate {summary['cache_hit_rate']:.1%} "
        f"(trace best case {best:.1%}), TTFT p50 {summary['ttft_ms']['p50']} ms"
    )
    plot_latency_cdfs(
        {"replay": latency_arrays(recs)}, Path(args.out).parent, prefix=f"{Path(args.out).stem}_"
    )
    return {
        "mode": "replay",
        "summary": summary,
        "best_hit_rate": best,
        "records": [r.to_json() for r in recs],
    }


def main(args: argparse.Namespace) -> int:
    try:
        if args.trace and args.capacity_curve:
            result = capacity_curve(args)
        elif args.trace and args.store_replay:
            from pdserve.bench.storereplay import store_replay

            records = read_mooncake_jsonl(args.trace, args.store_replay)
            per_tok = kv_bytes_per_token(args)
            bpb = max(1, round(MOONCAKE_BLOCK_TOKENS * args.length_scale)) * per_tok
            specs = [s.strip() for s in args.store_capacities.split(",") if s.strip()]
            result = store_replay(records, specs, bpb)
        elif args.trace and args.replay:
            result = replay(args)
        elif args.trace:
            raise ValueError("--trace needs --capacity-curve (simulation) or --replay N")
        elif args.compare_kvstore:
            result = compare_kvstore(args)
        else:
            result = {"mode": "sessions", "addr": args.addr} | sessions_once(args.addr, args)
    except ValueError as exc:
        raise SystemExit(f"pdserve bench multiturn: {exc}") from None
    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(f"wrote {write_json(args.out, result)}")
    return 0
