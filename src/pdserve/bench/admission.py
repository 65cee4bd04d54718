"""`pdserve bench admission`: how long a decode takes, after the last KV layer arrived, to
admit the request into its batch, compared with the prefill's compute time.

Starts a 1P1D cluster (real processes on 127.0.0.1), sends requests of several prompt lengths
one at a time (no queueing in the numbers), and per length reads
  - the decode's counters `decode_admission_delay_ms_sum` / `decode_admitted` (Info RPC; the
    delay runs from the last layer's receive completing to the request being admitted, i.e.
    the KV write into the paged cache plus the hop to the engine thread), as deltas;
  - `usage.stages.prefill_ms` of each response (the prefill's compute time).
Prints one row per length: mean delay, mean prefill, and delay as a fraction of prefill.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_LENGTHS = (16, 64, 256, 1024)


@dataclass
class Row:
    prompt_tokens: int
    requests: int
    admitted: int
    admission_delay_ms: float  # mean per admitted request
    prefill_ms: float  # mean usage.stages.prefill_ms
    transfer_ms: float  # mean usage.stages.transfer_ms (summed over prefill + decode sides)
    ratio: float  # admission_delay_ms / prefill_ms


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "admission",
        help="decode admission delay after the last KV layer, vs the prefill time (1P1D)",
    )
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--requests", type=int, default=24, help="requests in all (split by length)")
    p.add_argument(
        "--lengths",
        default=",".join(map(str, DEFAULT_LENGTHS)),
        help="prompt lengths, comma-separated (clipped to the model's context)",
    )
    p.add_argument("--max-tokens", type=int, default=4, help="tokens per request (>= 2)")
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="also write the rows as JSON here")
    p.set_defaults(func=main)


def _model_limits(model_dir: str) -> tuple[int, int]:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return int(cfg["vocab_size"]), int(cfg.get("max_position_embeddings") or 2048)


def measure(
    cluster: Any, lengths: list[int], per_length: int, max_tokens: int, vocab: int, seed: int
) -> list[Row]:
    from pdserve.client import Client

    rng = random.Random(seed)
    rows = []
    with Client(cluster.addr, timeout=300.0) as client:
        # warm-up: first-call costs (allocator, UCX endpoints) stay out of the table
        client.generate(token_ids=[5, 6, 7], max_tokens=2, temperature=0.0, ignore_eos=True)
        for n in lengths:
            before = cluster.worker_counters("decode0")
            prefill_ms = transfer_ms = 0.0
            for _ in range(per_length):
                prompt = [rng.randrange(2, vocab) for _ in range(n)]  # distinct: no cache hits
                res = client.generate(
                    token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                )
                prefill_ms += res.usage.stages["prefill_ms"]
                transfer_ms += res.usage.stages["transfer_ms"]
            after = cluster.worker_counters("decode0")
            admitted = int(after["decode_admitted"] - before["decode_admitted"])
            delay = after["decode_admission_delay_ms_sum"] - before["decode_admission_delay_ms_sum"]
            mean_delay = delay / max(1, admitted)
            mean_prefill = prefill_ms / per_length
            rows.append(
                Row(
                    prompt_tokens=n,
                    requests=per_length,
                    admitted=admitted,
                    admission_delay_ms=mean_delay,
                    prefill_ms=mean_prefill,
                    transfer_ms=transfer_ms / per_length,
                    ratio=mean_delay / mean_prefill if mean_prefill > 0 else float("nan"),
                )
            )
    return rows


def format_table(rows: list[Row]) -> str:
    head = f"{'prompt':>7} {'reqs':>5} {'admit':>6} {'delay ms':>9} {'prefill ms':>11} "
    head += f"{'transfer ms':>12} {'delay/prefill':>14}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.prompt_tokens:>7} {r.requests:>5} {r.admitted:>6} {r.admission_delay_ms:>9.3f} "
            f"{r.prefill_ms:>11.3f} {r.transfer_ms:>12.3f} {r.ratio:>14.3f}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    from pdserve.launcher import Cluster, ClusterConfig

    if args.max_tokens < 2:
        raise SystemExit("--max-tokens must be >= 2 (a 1-token request is never admitted)")
    config = ClusterConfig(
        model=args.model, port=0, prefill=1, decode=1,
        worker_args=["--num-blocks", str(args.num_blocks)],
    )  # fmt: skip
    started = time.perf_counter()
    with Cluster(config) as cluster:
        vocab, max_pos = _model_limits(cluster.model_dir)
        room = max_pos - args.max_tokens
        lengths = sorted({min(int(x), room) for x in args.lengths.split(",") if x.strip()})
        per_length = max(1, args.requests // len(lengths))
        print(
            f"pdserve bench admission: model {cluster.model_dir}, 1P1D, "
            f"{per_length} request(s) per length, max_tokens {args.max_tokens}",
            flush=True,
        )
        rows = measure(cluster, lengths, per_length, args.max_tokens, vocab, args.seed)
    print(format_table(rows))
    print(f"({time.perf_counter() - started:.1f} s in all)")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return 0
