"""`pdserve model make-tiny DIR ...`: write a deterministic random checkpoint (see model/tiny.py).

`pdserve model info DIR`: print the parsed config and fingerprint of a checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("model", help="model utilities (make-tiny, info)")
    sub = parser.add_subparsers(dest="model_command", required=True)

    mk = sub.add_parser("make-tiny", help="write a tiny random checkpoint + BPE tokenizer")
    mk.add_argument("dir", help="output directory")
    mk.add_argument(
        "--preset",
        choices=["bench50m"],
        default=None,
        help="start from a preset (bench50m: llama-shaped, ~41M params)",
    )
    mk.add_argument(
        "--family", choices=["llama", "qwen2", "qwen3", "mistral", "gemma4"], default=None
    )
    mk.add_argument("--seed", type=int, default=None)
    for flag, dest in (
        ("--hidden", "hidden"),
        ("--layers", "layers"),
        ("--heads", "heads"),
        ("--kv-heads", "kv_heads"),
        ("--intermediate", "intermediate"),
        ("--vocab", "vocab"),
        ("--max-pos", "max_pos"),
        ("--head-dim", "head_dim"),
        ("--sliding-window", "sliding_window"),
    ):
        mk.add_argument(flag, dest=dest, type=int, default=None)
    mk.add_argument(
        "--tie",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tie lm_head to the embedding (default: --no-tie)",
    )
    mk.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    mk.add_argument(
        "--if-missing",
        action="store_true",
        help="do nothing when DIR already holds a checkpoint (config.json); for init jobs",
    )
    mk.set_defaults(func=_make_tiny)

    info = sub.add_parser("info", help="print a checkpoint's parsed config and fingerprint")
    info.add_argument("dir")
    info.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    info.set_defaults(func=_info)


def _make_tiny(args: argparse.Namespace) -> int:
    from pdserve.model.tiny import PRESETS, TinySpec, make_tiny, resolve

    if args.if_missing and (Path(args.dir) / "config.json").exists():
        print(json.dumps({"dir": str(args.dir), "skipped": "config.json exists"}))
        return 0

    spec = PRESETS[args.preset] if args.preset else TinySpec()
    overrides = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(TinySpec)
        if getattr(args, f.name, None) is not None
    }
    try:
        spec = resolve(dataclasses.replace(spec, **overrides))
    except ValueError as exc:
        raise SystemExit(f"make-tiny: {exc}") from exc
    out = make_tiny(args.dir, spec)
    print(json.dumps({"dir": str(out), **dataclasses.asdict(spec)}))
    return 0


def _info(args: argparse.Namespace) -> int:
    from pdserve.model.loader import load_model

    loaded = load_model(args.dir, dtype=args.dtype)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    print(
        json.dumps(
            {
                "fingerprint": loaded.fingerprint,
                "parameters": n_params,
                "dtype": str(loaded.dtype).removeprefix("torch."),
                "config": loaded.config.to_dict(),
            },
            indent=2,
        )
    )
    return 0
