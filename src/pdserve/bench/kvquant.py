"""`pdserve bench kvquant`: quality and capacity of quantized KV (int8, fp8 e4m3) vs full
precision, on a real checkpoint with the real model and the torch attention backend.

Quality (teacher-forced): a full-precision KV run greedily continues N random prompts for T
tokens; each quantized arm then replays the same tokens (prefill of the prompt, then T decode
steps of the whole batch, each fed the reference token) with its KV cache quantized. At each
of the T+1 predicted positions we compare logits to the reference run: max |error|, error
RMS relative to the logits' RMS, and whether the argmax agrees. A position is *decisive* when
the reference top-2 margin is >= `--margin`; near-ties (random weights make them common) are
counted apart.

Capacity: bytes per block of every layer (elements + scales) for each dtype, the number of
blocks (and so the decode batch at a fixed context) a fixed memory holds, vs bf16.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.bench.report import write_json
from pdserve.kv import quant
from pdserve.model.attention.metadata import AttentionMetadata
from pdserve.model.loader import allocate_kv_caches, load_model

ARMS = ("int8", "fp8_e4m3")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("kvquant", help="quantized KV: quality and capacity vs full KV")
    p.add_argument("--model", action="append", required=True, help="checkpoint dir (repeat)")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=128, help="teacher-forced tokens per prompt")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--margin", type=float, default=0.5, help="decisive: top-2 margin >= this")
    p.add_argument("--memory", default="1GiB", help="fixed KV memory for the capacity table")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/kvquant.json")
    p.set_defaults(func=main)


def _caches(kind: str, cfg: Any, num_blocks: int, bs: int, dtype: torch.dtype) -> list:
    if quant.is_quantized(kind):
        return [
            quant.allocate(kind, num_blocks, bs, cfg.num_kv_heads, cfg.head_dim)
            for _ in range(cfg.num_layers)
        ]
    return allocate_kv_caches(cfg, num_blocks, bs, dtype)


@torch.inference_mode()
def run_arm(
    model: Any, cfg: Any, kind: str, prompts: torch.Tensor, forced: torch.Tensor | None,
    tokens: int, bs: int, dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Logits `[N, tokens + 1, vocab]` and the tokens fed (`forced`, or greedy when None)."""
    n, plen = prompts.shape
    per_seq = -(-(plen + tokens) // bs)
    caches = _caches(kind, cfg, n * per_seq, bs, dtype)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
    meta = AttentionMetadata.build([plen] * n, [plen] * n, tables, bs)
    pos = torch.arange(plen).repeat(n)
    hidden = model(prompts.reshape(-1), pos, caches, meta)
    logits = [model.compute_logits(hidden.view(n, plen, -1)[:, -1])]
    fed = []
    for t in range(tokens):
        nxt = forced[:, t] if forced is not None else logits[-1].argmax(-1)
        fed.append(nxt)
        seq_len = plen + t + 1
        meta = AttentionMetadata.build([1] * n, [seq_len] * n, tables, bs)
        hidden = model(nxt, torch.full((n,), seq_len - 1), caches, meta)
        logits.append(model.compute_logits(hidden))
    return torch.stack(logits, 1), torch.stack(fed, 1)


def compare(ref: torch.Tensor, got: torch.Tensor, margin: float) -> dict[str, Any]:
    top2 = ref.topk(2, dim=-1).values
    decisive = (top2[..., 0] - top2[..., 1]) >= margin
    agree = ref.argmax(-1) == got.argmax(-1)
    err = (got - ref).float()
    rms = ref.float().pow(2).mean().sqrt()
    nd = int(decisive.sum())
    return {
        "positions": int(agree.numel()),
        "decisive_positions": nd,
        "agreement_decisive": float(agree[decisive].float().mean()) if nd else None,
        "disagreements_decisive": int((~agree & decisive).sum()),
        "near_tie_positions": int((~decisive).sum()),
        "agreement_near_ties": float(agree[~decisive].float().mean())
        if nd < agree.numel()
        else None,
        "agreement_all": float(agree.float().mean()),
        "logit_max_abs_err": float(err.abs().max()),
        "logit_rel_rms_err": float(err.pow(2).mean().sqrt() / rms),
    }


def capacity(cfg: Any, bs: int, memory: int) -> dict[str, Any]:
    per_elem = {"float32": 4, "bfloat16": 2}
    rows: dict[str, Any] = {}
    for kind in ("float32", "bfloat16", *ARMS):
        if quant.is_quantized(kind):
            layer = quant.row_bytes(bs, cfg.num_kv_heads, cfg.head_dim)
        else:
            layer = 2 * bs * cfg.num_kv_heads * cfg.head_dim * per_elem[kind]
        block = layer * cfg.num_layers
        rows[kind] = {"bytes_per_block": block, "blocks_in_memory": memory // block}
    base = rows["bfloat16"]
    for r in rows.values():
        r["batch_vs_bf16"] = r["blocks_in_memory"] / base["blocks_in_memory"]
        r["bytes_vs_bf16"] = r["bytes_per_block"] / base["bytes_per_block"]
    return rows


def one_model(path: str, args: argparse.Namespace, memory: int) -> dict[str, Any]:
    loaded = load_model(path)
    model, cfg = loaded.model, loaded.config
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, cfg.vocab_size, (args.prompts, args.prompt_len), generator=g)
    bs = args.block_size
    t0 = time.perf_counter()
    full = str(loaded.dtype).removeprefix("torch.")
    ref, fed = run_arm(model, cfg, full, prompts, None, args.tokens, bs, loaded.dtype)
    out: dict[str, Any] = {"model": path, "full_kv_dtype": full, "arms": {}}
    times = {full: time.perf_counter() - t0}
    for kind in ARMS:
        t0 = time.perf_counter()
        got, _ = run_arm(model, cfg, kind, prompts, fed, args.tokens, bs, loaded.dtype)
        times[kind] = time.perf_counter() - t0
        out["arms"][kind] = compare(ref, got, args.margin)
    out["seconds"] = times
    out["capacity"] = capacity(cfg, bs, memory)
    print(f"== {path} ({full} weights; {args.prompts} prompts x {args.tokens} tokens)")
    print(f"{'KV':>10}{'agree@decisive':>16}{'decisive':>10}{'near-tie agree':>16}"
          f"{'rel RMS err':>13}{'max |err|':>11}{'batch vs bf16':>15}")  # fmt: skip
    for kind, r in out["arms"].items():
        c = out["capacity"][kind]
        print(
            f"{kind:>10}{r['agreement_decisive']:>16.4f}{r['decisive_positions']:>10}"
            f"{r['agreement_near_ties'] or 0:>16.4f}{r['logit_rel_rms_err']:>13.4f}"
            f"{r['logit_max_abs_err']:>11.4f}{c['batch_vs_bf16']:>15.3f}"
        )
    return out


def main(args: argparse.Namespace) -> int:
    from pdserve.bench.cachesim import parse_capacity

    memory = parse_capacity(args.memory) or (1 << 30)
    torch.manual_seed(args.seed)
    result = {"models": [one_model(m, args, memory) for m in args.model]}
    result["config"] = {k: v for k, v in vars(args).items() if k != "func"}
    print(f"wrote {write_json(Path(args.out), result)}")
    return 0
