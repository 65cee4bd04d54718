"""One attention layer, three ways: the fused invariant kernel, the torch `fixed` path (its
fallback) and SDPA (`--no-batch-invariant`), on bench50m's shapes by default.

    python -m benchmarks.attention_backends [--dtype bfloat16,float32] [--threads 1]

Per case (decode: B rows at context C; prefill: B prompts of P tokens, one step) it times
`backend.forward` (cache write + attention; the per-step `prepare` once, outside) with process
CPU time, arms alternating repeat by repeat, best of --repeats, and prints microseconds per
layer call and the ratios to SDPA. The kernel's first-use build (or cache load) is timed too.
"""

from __future__ import annotations

import argparse
import time

import torch

from pdserve.model.attention import AttentionMetadata, TorchAttentionBackend, fixed_kernel

BS = 16


def _case(kind: str, batch: int, length: int) -> tuple[list[int], list[int]]:
    """(query_lens, seq_lens): decode rows at context `length`, or whole prompts of it."""
    if kind == "decode":
        return [1] * batch, [length] * batch
    return [length] * batch, [length] * batch


def _arms(h: int, hkv: int, d: int) -> dict[str, TorchAttentionBackend]:
    kernel, torch_fixed, sdpa = (TorchAttentionBackend(h, hkv, d) for _ in range(3))
    kernel.use_kernel, torch_fixed.use_kernel = True, False
    sdpa.batch_invariant = False
    return {"kernel": kernel, "torch_fixed": torch_fixed, "sdpa": sdpa}


def bench_case(kind, batch, length, dtype, h, hkv, d, repeats, inner) -> dict[str, float]:
    qlens, slens = _case(kind, batch, length)
    nb = -(-length // BS)
    tables = [list(range(1 + i * nb, 1 + (i + 1) * nb)) for i in range(batch)]
    meta = AttentionMetadata.build(qlens, slens, tables, BS)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(1 + batch * nb, 2, BS, hkv, d, generator=g).to(dtype)
    t = meta.num_tokens
    q, k, v = (torch.randn(t, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))
    arms = _arms(h, hkv, d)
    plans = {name: be.prepare(meta) for name, be in arms.items()}
    best = dict.fromkeys(arms, float("inf"))
    for _ in range(repeats):
        for name, be in arms.items():
            t0 = time.process_time()
            for _ in range(inner):
                be.forward(plans[name], q, k, v, cache, None)
            best[name] = min(best[name], (time.process_time() - t0) / inner)
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dtype", default="bfloat16,float32")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--heads", default="8,2,64", help="H,Hkv,D (default: bench50m)")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    h, hkv, d = (int(x) for x in args.heads.split(","))
    t0 = time.perf_counter()
    ok = fixed_kernel.load() is not None
    print(f"kernel load (build or cache): {time.perf_counter() - t0:.1f} s, available: {ok}")
    if not ok:
        return 1
    cases = [("decode", 1, 144), ("decode", 8, 144), ("decode", 32, 144), ("decode", 8, 1024)]
    cases += [("prefill", 1, 128), ("prefill", 8, 128), ("prefill", 1, 1024)]
    print("dtype     case              kernel us  torch_fixed us  sdpa us  kernel/sdpa  fixed/sdpa")
    with torch.inference_mode():
        for dt in args.dtype.split(","):
            dtype = getattr(torch, dt)
            for kind, b, n in cases:
                inner = 20 if kind == "decode" else 2
                r = bench_case(kind, b, n, dtype, h, hkv, d, args.repeats, inner)
                us = {k: v * 1e6 for k, v in r.items()}
                print(
                    f"{dt:9s} {kind:7s} B={b:<2d} n={n:<5d} {us['kernel']:9.0f} "
                    f"{us['torch_fixed']:15.0f} {us['sdpa']:8.0f} "
                    f"{us['kernel'] / us['sdpa']:11.2f}x {us['torch_fixed'] / us['sdpa']:10.2f}x"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
