"""`pdserve predictor train --data FILE --out DIR`: fit the offline length model
(deterministic; the shipped default lives in pdserve/router/scheduling/predictor/default).

`pdserve predictor evaluate --data FILE [--predictor DIR] [--split val] [--online] --json`:
Kendall tau (pooled and median per model), Spearman, MAE of log length, p90
coverage and 100-token bucket accuracy. A Mooncake-format trace (rows with
`hash_ids` and `output_length`) is replayed online in arrival order, learning
as it goes; `--online` does the same for length-data rows."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("predictor", help="output-length predictor (train, evaluate)")
    sub = parser.add_subparsers(dest="predictor_command", required=True)

    tr = sub.add_parser("train", help="fit the offline text model on length data")
    tr.add_argument("--data", required=True, help="JSONL(.gz) with prompt, model, length")
    tr.add_argument("--out", required=True, help="output directory (model.json, weights.npz)")
    tr.add_argument("--split", default="train", help="rows whose prompt_split is this ('' = all)")
    tr.add_argument("--dim", type=int, default=1 << 16, help="hashed feature dimension")
    tr.add_argument("--ridge", type=float, default=1.0, help="ridge penalty")
    tr.set_defaults(func=run_train)

    ev = sub.add_parser("evaluate", help="score a predictor on length data or a trace")
    ev.add_argument("--data", required=True, help="JSONL(.gz): length data or Mooncake trace")
    ev.add_argument("--predictor", default=None, help="artifact DIR (default: the shipped one)")
    ev.add_argument("--split", default=None, help="only rows whose prompt_split is this")
    ev.add_argument("--online", action="store_true", help="replay in order, learning online")
    ev.add_argument("--no-text-model", action="store_true", help="online: no offline prior")
    ev.add_argument("--limit", type=int, default=0, help="first N rows only (0 = all)")
    ev.add_argument("--json", action="store_true", help="print one JSON object")
    ev.set_defaults(func=run_evaluate)


def _rows(args: argparse.Namespace) -> list[dict]:
    from pdserve.router.scheduling.predictor.evaluate import read_rows

    rows = []
    for row in read_rows(args.data):
        if args.split and row.get("prompt_split", args.split) != args.split:
            continue
        rows.append(row)
        if getattr(args, "limit", 0) and len(rows) >= args.limit:
            break
    return rows


def run_train(args: argparse.Namespace) -> int:
    from pdserve.router.scheduling.predictor.offline import TrainConfig, save_model, train

    t0 = time.monotonic()
    rows = _rows(args)
    if not rows:
        print(f"no rows in {args.data} (split {args.split!r})", file=sys.stderr)
        return 2
    model = train(rows, TrainConfig(dim=args.dim, ridge=args.ridge))
    out = save_model(model, args.out)
    print(
        json.dumps(
            {
                "out": str(out),
                "train_rows": model.meta["train_rows"],
                "train_prompts": model.meta["train_prompts"],
                "models": len(model.cal),
                "seconds": round(time.monotonic() - t0, 1),
            }
        )
    )
    return 0


def run_evaluate(args: argparse.Namespace) -> int:
    from pdserve.router.scheduling.predictor.evaluate import (
        default_online,
        evaluate_offline,
        evaluate_online,
        is_trace,
    )
    from pdserve.router.scheduling.predictor.offline import DEFAULT_DIR, TextLengthModel

    rows = _rows(args)
    if not rows:
        print(f"no rows in {args.data}", file=sys.stderr)
        return 2
    trace = is_trace(rows[0])
    text_model = None
    if not (trace or args.no_text_model):
        text_model = TextLengthModel.load(args.predictor or DEFAULT_DIR)
    if trace or args.online:
        if trace:
            rows.sort(key=lambda r: r.get("timestamp", 0))  # stable: file order on ties
        result = evaluate_online(default_online(text_model), rows)
    else:
        assert text_model is not None
        result = evaluate_offline(text_model, rows)
    result["data"] = str(args.data)
    if args.json:
        print(json.dumps(result, sort_keys=True))
        return 0
    for key in ("mode", "n", "kendall_tau", "kendall_tau_per_model", "models_evaluated",
                "spearman", "mae_log", "p90_coverage", "bucket_accuracy"):  # fmt: skip
        print(f"{key:>22}: {result.get(key)}")
    return 0
