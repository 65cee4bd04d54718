"""The fused attention kernel alone (fixed_kernel.attend_paged), against a baseline build of
its sources at another git revision, on bench50m's attention shapes by default.

    python -m benchmarks.attention_kernel [--baseline REV] [--dtype bfloat16] [--threads 1]

Cases: prefill (B prompts of P tokens, one call), chunk (B chunks of 128 tokens ending at
context C) and decode (B rows at context C). Per case
and arm: process CPU time of one layer call, best of --repeats (arms alternate repeat by
repeat), GFLOP/s = 4 * H * D * (visible keys summed over rows) / time, and whether the
outputs of the two arms are bitwise equal. The baseline (`git show REV:` of fixed_attn.cpp,
fixed_attn_math.h and, where it exists, model/csrc/avx512_math.h) is built once under its own extension name in $TORCH_EXTENSIONS_DIR.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from typing import Any

import torch

from pdserve.model import cpp_ext
from pdserve.model.attention import fixed_kernel
from pdserve.model.kernel_settings import KernelSettings

BS = 16
_CSRC = "src/pdserve/model/attention/csrc"
_SHARED_HEADER = "src/pdserve/model/csrc/avx512_math.h"


def build_baseline(rev: str) -> Any:
    """The kernel module built from the sources at git revision `rev`, as the served build
    variant (fixed_kernel.variant_for: on a CPU with AVX512-BF16 the bf16 dot-product build)."""
    root = Path(fixed_kernel.__file__).resolve().parents[4]
    sha = subprocess.run(
        ["git", "-C", str(root), "rev-parse", "--short", rev],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # the repository's layout under src/, so that relative includes resolve as in the tree
    # (fixed_attn_math.h includes ../../csrc/avx512_math.h from the shared helpers)
    variant = fixed_kernel.variant_for(KernelSettings.from_env().attn_kernel)
    tree = cpp_ext.build_dir("pdserve_fixed_attn_base", f"{sha}_{variant}") / "src"
    for rel in (f"{_CSRC}/fixed_attn.cpp", f"{_CSRC}/fixed_attn_math.h", _SHARED_HEADER):
        shown = subprocess.run(
            ["git", "-C", str(root), "show", f"{rev}:{rel}"], capture_output=True, text=True
        )
        if shown.returncode != 0:
            if rel == _SHARED_HEADER:  # revisions before the shared header
                continue
            raise RuntimeError(f"git show {rev}:{rel}: {shown.stderr.strip()}")
        path = tree / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != shown.stdout:
            path.write_text(shown.stdout)
    src = tree / _CSRC
    flags = fixed_kernel.flags_for(variant)
    return cpp_ext.build(
        "pdserve_fixed_attn_base", f"{sha}_{variant}", src / "fixed_attn.cpp", flags
    )


def make_case(kind: str, batch: int, length: int, h: int, hkv: int, d: int, dtype, window=0):
    """Kernel arguments: `batch` prompts of `length` tokens (prefill), `batch` last chunks of
    128 tokens at context `length` (chunk) or `batch` decode rows at context `length`,
    shuffled blocks; the FLOPs count the keys each row sees (its window)."""
    g = torch.Generator().manual_seed(0)
    nb = -(-length // BS)
    cache = torch.randn(batch * nb + 1, 2, BS, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(batch * nb, generator=g) + 1
    tables = perm.view(batch, nb).to(torch.int32)
    qlen = {"prefill": length, "chunk": 128, "decode": 1}[kind]
    tok_seq = torch.arange(batch).repeat_interleave(qlen).to(torch.int32)
    tok_pos = torch.arange(length - qlen, length).repeat(batch).to(torch.int32)
    ctx = torch.full((batch,), length, dtype=torch.int32)
    q = torch.randn(batch * qlen, h, d, generator=g).to(dtype)
    seen = tok_pos.long() + 1
    keys = int((seen.clamp(max=window) if window > 0 else seen).sum())
    return (q, cache, tables, tok_seq, tok_pos, ctx), 4 * h * d * keys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--baseline", default=None, help="git revision to compare against")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heads", default="8,2,64", help="H,Hkv,D (default: bench50m)")
    p.add_argument("--window", type=int, default=0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--kinds", default="prefill,chunk,decode")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    h, hkv, d = (int(x) for x in args.heads.split(","))
    ext = fixed_kernel.load()
    if ext is None:
        return 1
    arms: dict[str, Any] = {}
    if args.baseline:
        arms["base"] = build_baseline(args.baseline)
    arms["new"] = ext
    scale = d**-0.5
    cases = [("prefill", b, 128) for b in (1, 8, 32)]
    cases += [("chunk", b, 1024) for b in (1, 8)]
    cases += [("decode", b, c) for c in (128, 1024) for b in (1, 8, 32)]
    cases = [c for c in cases if c[0] in args.kinds.split(",")]
    print(f"H={h} Hkv={hkv} D={d} window={args.window} threads={args.threads}, one layer call")
    cols = "".join(f" {n + ' ms':>9s} {n + ' GF/s':>9s}" for n in arms)
    print(f"dtype     case                 {cols}  speedup  bit-equal")
    with torch.inference_mode():
        for dt in args.dtype.split(","):
            dtype = getattr(torch, dt)
            for kind, b, n in cases:
                a, flops = make_case(kind, b, n, h, hkv, d, dtype, args.window)
                inner = max(1, int(2e8 // flops))
                best = dict.fromkeys(arms, float("inf"))
                outs = {}
                for _ in range(args.repeats):
                    for name, m in arms.items():
                        t0 = time.process_time()
                        for _ in range(inner):
                            outs[name] = m.attend_paged(*a, args.window, scale)
                        best[name] = min(best[name], (time.process_time() - t0) / inner)
                row = "".join(f" {best[k] * 1e3:9.3f} {flops / best[k] / 1e9:9.1f}" for k in arms)
                sp = f"{best['base'] / best['new']:7.2f}x" if "base" in arms else ""
                eq = str(torch.equal(outs["base"], outs["new"])) if "base" in arms else ""
                print(f"{dt:9s} {kind:7s} B={b:<2d} n={n:<5d} {row}  {sp}  {eq}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
