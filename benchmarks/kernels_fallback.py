"""What the C++ kernels buy: the engine with its compiled kernels against the same engine with
every kernel switched off, which is what runs on a machine without a compiler (the torch
fixed attention, oneDNN or plain linears, torch pointwise ops, the module loop).

Both arms live in one process, each on its own copy of the model, and alternate repeat by
repeat: a prefill of `--batch` prompts of `--prompt-len` tokens in one step, then `--gen-len`
decode steps. Time is process CPU time (`--threads 1` keeps it honest on a shared machine).
Prints each arm's kernel record, its tokens/s, and fallback time / kernel time per phase with
a 95 % confidence interval over the paired repeats (t on the log ratios).

    .venv/bin/python -m benchmarks.kernels_fallback [--model DIR] [--dtype auto] [--repeats 7]
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.model import tiny
from pdserve.model.kernel_settings import KernelSettings

OFF = KernelSettings(
    attn_kernel="off",
    amx_linear=False,
    avx512_bf16_linear=False,
    bf16_pointwise=False,
    direct_loop=False,
)  # what an engine runs when no kernel is built
T95 = {2: 12.71, 3: 4.30, 4: 3.18, 5: 2.78, 6: 2.57, 7: 2.45, 8: 2.36, 9: 2.31, 10: 2.26}


def _phases(e: LLMEngine, prompts: list[list[int]], gen: int) -> tuple[float, float]:
    """(prefill CPU s, decode CPU s) of one batch."""
    params = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        e.add_request(f"r{i}", p, params)
    t0 = time.process_time()
    e.step()  # the whole batch's prefill (the budget holds it) and its first tokens
    t1 = time.process_time()
    while e.has_unfinished_requests():
        e.step()
    return t1 - t0, time.process_time() - t1


def _ci(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean and 95 % CI of paired ratios."""
    logs = [math.log(r) for r in ratios]
    m = statistics.fmean(logs)
    half = T95.get(len(logs), 2.0) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(m), math.exp(m - half), math.exp(m + half)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="checkpoint dir (default: make-tiny's bench50m preset)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = args.model or str(
        tiny.make_tiny(Path(tempfile.mkdtemp()) / "bench50m", tiny.PRESETS["bench50m"])
    )
    tokens = args.batch * args.prompt_len

    def engine(settings: KernelSettings) -> LLMEngine:
        return LLMEngine(
            EngineConfig(
                model,
                dtype=args.dtype,
                max_num_batched_tokens=tokens,
                max_num_seqs=args.batch,
                enable_prefix_caching=False,
                kernels=settings,
            )
        )

    arms = {"kernels": engine(KernelSettings()), "fallback": engine(OFF)}
    g = torch.Generator().manual_seed(0)
    vocab = arms["kernels"].vocab_size
    print(" ".join(["python -m benchmarks.kernels_fallback", *sys.argv[1:]]))
    for name, e in arms.items():
        print(f"{name:>8}: {e.dtype}, {e.kernels.summary()}")
    times: dict[str, list[tuple[float, float]]] = {a: [] for a in arms}
    for r in range(args.repeats + 1):  # the first round warms up
        prompts = [
            torch.randint(2, vocab, (args.prompt_len,), generator=g).tolist()
            for _ in range(args.batch)
        ]
        for name in arms if r % 2 else reversed(list(arms)):
            pre, dec = _phases(arms[name], prompts, args.gen_len)
            if r:
                times[name].append((pre, dec))
    for i, phase in enumerate(("prefill", "decode")):
        n_tok = tokens if phase == "prefill" else args.batch * (args.gen_len - 1)
        rates = {a: n_tok / statistics.median(t[i] for t in ts) for a, ts in times.items()}
        ratios = [f[i] / k[i] for k, f in zip(times["kernels"], times["fallback"], strict=True)]
        gm, lo, hi = _ci(ratios)
        print(
            f"{phase:>8}: kernels {rates['kernels']:.0f} tok/s, fallback {rates['fallback']:.0f}"
            f" tok/s; fallback time / kernel time {gm:.2f}x (95 % CI {lo:.2f}-{hi:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
