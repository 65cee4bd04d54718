"""One bf16 linear, two kernels: oneDNN's packed linear (`PackedLinear`) and this package's
batch-invariant kernel (`AmxLinear` on a CPU with AMX, else `Avx512Bf16Linear` on one with
AVX512-BF16), by shape and row count.

    python -m benchmarks.linear_kernels [--shapes 512x2048,2048x512] [--rows 1,8,32,128,512]

Per shape it makes enough distinct weights to fill ~256 MB, so a few-row product reads its
weights from memory, not the cache (decode's case); each row count is timed with process CPU
time, one thread, kernels alternating, best of --repeats. Prints microseconds per call, GB/s
of weight read and GFLOP/s. Needs AMX or AVX512-BF16 and the kernel built (else it says so and
exits 2).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from pdserve.model import amx_linear, avx512_bf16_linear
from pdserve.model.cpu_linear import PackedLinear

WEIGHT_BYTES = 256e6


def _best(fn: Callable[[], object], reps: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.process_time()
        for _ in range(reps):
            fn()
        best = min(best, (time.process_time() - t0) / reps)
    return best


def _avx512(lins: list[nn.Linear]) -> list[nn.Module]:
    """As `pack_linears` packs them: back to back in one storage (huge pages)."""
    packed = avx512_bf16_linear.pack_all([lin.weight for lin in lins])
    return [
        avx512_bf16_linear.Avx512Bf16Linear.from_linear(*lp)
        for lp in zip(lins, packed, strict=True)
    ]


def kernel() -> tuple[str, Callable[[list[nn.Linear]], list[nn.Module]]] | None:
    """(name, constructor of a list) of this CPU's invariant kernel: AMX, else AVX512-BF16."""
    if amx_linear.available():
        return "AMX", lambda lins: [amx_linear.AmxLinear.from_linear(lin) for lin in lins]
    if avx512_bf16_linear.available():
        return "AVX512", _avx512
    return None


def run(shapes: list[tuple[int, int]], rows: list[int], repeats: int) -> list[dict[str, float]]:
    out = []
    found = kernel()
    assert found is not None
    make = found[1]
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for k, n in shapes:
            count = max(1, int(WEIGHT_BYTES // (k * n * 2)))
            lins = [nn.Linear(k, n, bias=False).to(torch.bfloat16) for _ in range(count)]
            arms = {
                "onednn": [PackedLinear(lin) for lin in lins],
                "kernel": make(lins),
            }
            for m in rows:
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                reps = max(1, 64 // count) if m <= 32 else 3
                times = {name: float("inf") for name in arms}
                for _ in range(repeats):  # arms alternate
                    for name, mods in arms.items():
                        t = _best(lambda mods=mods, x=x: [mod(x) for mod in mods], reps, 1) / count
                        times[name] = min(times[name], t)
                row = {"k": k, "n": n, "rows": m}
                for name, t in times.items():
                    row[f"{name}_us"] = t * 1e6
                    row[f"{name}_gb_s"] = k * n * 2 / t / 1e9
                    row[f"{name}_gflop_s"] = 2 * m * k * n / t / 1e9
                out.append(row)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="512x768,512x512,512x4096,2048x512,512x16384",
                    help="KxN list (in_features x out_features)")  # fmt: skip
    ap.add_argument("--rows", default="1,8,32,128,512")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    found = kernel()
    if found is None:
        print("no invariant bf16 linear kernel on this machine (no AMX / AVX512-BF16, or no build)")
        return 2
    name = found[0]
    torch.set_num_threads(1)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    rows = [int(v) for v in args.rows.split(",")]
    print(f"{'K x N':>11} {'rows':>5} | {'oneDNN us':>10} {'GB/s':>6} {'GFLOP/s':>8} | "
          f"{name + ' us':>10} {'GB/s':>6} {'GFLOP/s':>8} | {name} / oneDNN time")  # fmt: skip
    for r in run(shapes, rows, args.repeats):  # type: ignore[arg-type]
        print(
            f"{r['k']:>5} x {r['n']:<5} {r['rows']:>5} | {r['onednn_us']:>10.1f} "
            f"{r['onednn_gb_s']:>6.1f} {r['onednn_gflop_s']:>8.0f} | {r['kernel_us']:>10.1f} "
            f"{r['kernel_gb_s']:>6.1f} {r['kernel_gflop_s']:>8.0f} | {r['kernel_us'] / r['onednn_us']:.2f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
