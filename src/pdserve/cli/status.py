"""`pdserve status`: instances, roles, load and cache hit rate of a running router."""

from __future__ import annotations

import argparse
import json
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("status", help="instances, roles, load, cache hit rate")
    p.add_argument(
        "--addr", default="127.0.0.1:50051", help="router HOST:PORT, or several replicas a:1,b:2"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--api-key", default=None, help="API key (default: $PDSERVE_CLIENT_API_KEY, if set)"
    )
    p.add_argument("--timeout", type=float, default=5.0, help="deadline, seconds")
    p.set_defaults(func=run)


def _step_ms(ewma: float) -> str:
    """The worker's engine step time (EWMA over its recent steps); '-' before its first."""
    return f"{ewma:.1f}" if ewma > 0 else "-"


def _dtype(status) -> str:
    """The dtype the workers serve, and the checkpoint's when it differs (e.g. `auto` serves
    a float32 checkpoint in bfloat16 on a CPU with AVX512-BF16/AMX)."""
    served = status.dtype or "- (no worker registered)"
    ckpt = getattr(status, "checkpoint_dtype", "")
    return f"{served} (checkpoint: {ckpt})" if ckpt and ckpt != status.dtype else served


def format_table(status) -> str:
    """Plain-text table of a pdserve.client.ClusterStatus."""
    header = (
        "INSTANCE",
        "ROLE",
        "STATE",
        "ADDRESS",
        "RUNNING",
        "WAITING",
        "FREE/TOTAL BLOCKS",
        "STEP MS",
        "HB AGE",
        "DTYPE",
    )
    rows = [header]
    for i in status.instances:
        rows.append(
            (
                i.instance_id,
                i.role,
                i.state,
                i.address,
                str(int(i.load["num_running"])),
                str(int(i.load["num_waiting"])),
                f"{int(i.load['free_blocks'])}/{int(i.load['total_blocks'])}",
                _step_ms(i.load.get("step_ms_ewma", 0.0)),
                f"{i.heartbeat_age_s:.1f}s",
                i.dtype or "-",
            )
        )
    widths = [max(len(r[c]) for r in rows) for c in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)).rstrip() for r in rows
    ]
    if not status.instances:
        lines.append("(no instances registered)")
    routers = getattr(status, "routers", [])
    if routers:
        lines += ["", f"routers ({len(routers)} known to {status.router_id or 'this one'}):"]
        for r in routers:
            http = f"  http {r.http_address}" if r.http_address else ""
            me = "  (answered)" if r.is_self else ""
            lines.append(
                f"  {r.router_id}  {r.address or '-'}{http}  reported by {r.workers} worker(s){me}"
            )
        if getattr(status, "shared_store", ""):
            lines.append(f"  shared store: {status.shared_store}")
    lines += [
        "",
        f"model: {status.model or '-'}    kvstore: {status.kvstore_address or '-'}",
        f"vocab: {status.vocab_size or '-'}    context: {status.context_length or '-'}    "
        f"block size: {status.block_size or '-'}    dtype: {_dtype(status)}",
        f"requests: {status.requests_total} total, {status.requests_running} running",
        f"prompt tokens: {status.prompt_tokens_total}, cached: {status.cached_tokens_total} "
        f"(hit rate {status.cache_hit_rate:.1%})",
        f"length predictor: {status.predictor or '-'}, running Kendall tau "
        f"{status.predictor_kendall_tau:.3f} over {status.predictor_observed} finished; "
        f"queue: {status.queue_waiting} waiting",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from pdserve.client import Client, PdserveClientError, Unavailable

    try:
        with Client(args.addr, max_retries=0, api_key=args.api_key) as client:
            status = client.status(timeout=args.timeout)
    except Unavailable as exc:
        print(f"error: cannot reach the router at {args.addr}: {exc.message}", file=sys.stderr)
        return 1
    except PdserveClientError as exc:
        print(f"error: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return 1
    print(json.dumps(status.to_dict(), indent=2) if args.json else format_table(status))
    return 0
