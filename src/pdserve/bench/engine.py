"""`pdserve bench engine`: prefill and decode throughput of the in-process engine against
transformers' own greedy `generate` (same weights, same threads, same run).

Method, per batch size B (B prompts of --prompt-len random ids, --gen-len new tokens each,
EOS ignored, greedy):
- ours: all B requests added at once; prefill time = until every request has its first token
  (the prompts fit one step's token budget); decode time = the rest; decode tokens/s counts the
  B * (gen_len - 1) tokens produced after the first.
- transformers: `generate(max_new_tokens=1)` timed as the prefill; `generate(max_new_tokens=
  gen_len)` minus that prefill as the decode.
Runs of ours and transformers alternate; each phase reports the best of --repeats runs.

--dtype takes a comma list (e.g. float32,bfloat16): each dtype gets its own engine and its own
transformers model in that dtype, measured in the same run (the bf16/fp32 ratio is printed).
--compare-variant adds, per dtype, an engine with batch_invariant=False; its runs alternate with
the invariant engine's (same prompts, same repeat), so both see the same machine load.
--limits also measures this machine's read bandwidth and GEMM peak per dtype
(pdserve.bench.limits) and prints the engine's achieved fraction of them: prefill FLOP/s /
GEMM peak and decode weight+KV bytes/s / bandwidth.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("engine", help="engine prefill/decode throughput vs transformers")
    p.add_argument("--model", help="checkpoint dir (default: make-tiny --preset bench50m)")
    p.add_argument("--cache-dir", default=None, help="where the preset model is made/kept")
    p.add_argument("--batch-sizes", default="1,8,32")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--gen-len", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3, help="best of N timed runs")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--device", default="cpu", help="torch device of both engines (cpu, cuda)")
    p.add_argument(
        "--dtype",
        default="auto",
        help="comma list of auto|float32|bfloat16, each measured in this run (default: auto, "
        "the serving default for the CPU)",
    )
    p.add_argument(
        "--compare-unpacked",
        action="store_true",
        help="also run each dtype with plain (not oneDNN-prepacked) weights, the old path",
    )
    p.add_argument(
        "--compare-variant",
        action="store_true",
        help="also run each dtype with batch_invariant=False (SDPA attention), alternating "
        "with the default invariant engine run by run: the cost of batch invariance",
    )
    p.add_argument(
        "--limits",
        action="store_true",
        help="also measure memory bandwidth and GEMM peak here and print achieved fractions",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="wall time, or process CPU time (steadier on a shared machine; use --threads 1)",
    )
    p.add_argument("--json", dest="json_out", default=None, help="write results to this file")
    p.set_defaults(func=run)


def preset_model(cache_dir: str | None) -> Path:
    """The ~50M Llama-shaped preset, made once with make-tiny (build then rename)."""
    import os
    import tempfile

    from pdserve.model import tiny

    home = Path(cache_dir) if cache_dir else tiny.default_home()
    target = home / "bench50m"
    if (target / "model.safetensors").is_file():
        return target
    home.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".bench50m-", dir=home))
    tiny.make_tiny(tmp, tiny.PRESETS["bench50m"])
    try:
        os.rename(tmp, target)
    except OSError:  # made concurrently by someone else
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (batch, prompt_len), generator=g).tolist()


def _synced(clock: Any, device: str) -> Any:
    """`clock` that first waits for the device's queued work (a cuda step returns before its
    kernels end unless something reads their result)."""
    if not str(device).startswith("cuda"):
        return clock
    import torch

    def tick() -> float:
        torch.cuda.synchronize()
        return clock()

    return tick


def bench_ours(
    engine: Any, prompts: list[list[int]], gen_len: int, clock: Any = time.perf_counter
) -> tuple[float, float]:
    """(prefill seconds, decode seconds) for one batch, measured with `clock`."""
    from pdserve.engine.params import SamplingParams

    clock = _synced(clock, engine.config.device)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    t0 = clock()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}", p, params)
    started: set[str] = set()
    t_first = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            started.add(out.request_id)
        if t_first is None and len(started) == len(prompts):
            t_first = clock()
    t_end = clock()
    assert t_first is not None
    return t_first - t0, t_end - t_first


def bench_hf(
    model: Any, prompts: list[list[int]], gen_len: int, clock: Any = time.perf_counter
) -> tuple[float, float]:
    """(prefill s, decode s) of a greedy run: the prompt's forward, then gen_len - 1 one-token
    forwards over the KV cache, each phase timed on its own (not a difference of two
    `generate` timings, which came out <= 0 on a busy machine). The model's forwards only: no
    `generate` loop overhead, so a lower bound on transformers' own time."""
    import inspect

    import torch

    # transformers 5 calls the KV cache argument `cache`; older releases `past_key_values`
    forward_args = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in forward_args else "past_key_values"
    clock = _synced(clock, model.device)
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        t0 = clock()
        out = model(input_ids=ids, attention_mask=mask, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)  # [batch, 1]
        t1 = clock()
        for _ in range(gen_len - 1):
            mask = torch.cat([mask, torch.ones_like(token)], dim=1)
            kv = {cache_arg: getattr(out, cache_arg)}
            out = model(input_ids=token, attention_mask=mask, use_cache=True, **kv)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        t2 = clock()
    decode = t2 - t1
    return t1 - t0, decode if gen_len > 1 and decode > 0 else float("nan")


def parse_dtypes(text: str, device: str = "cpu") -> list[str]:
    """ "auto,float32" -> resolved names, in order, without repeats (auto: the device's)."""
    from pdserve.dtypes import DTYPE_NAMES
    from pdserve.model.loader import auto_dtype

    out: list[str] = []
    for name in (t.strip() for t in text.split(",") if t.strip()):
        if name == "auto":
            name = str(auto_dtype(device)).removeprefix("torch.")
        if name not in DTYPE_NAMES:
            raise SystemExit(f"--dtype: unknown dtype {name!r} (auto | {' | '.join(DTYPE_NAMES)})")
        if name not in out:
            out.append(name)
    if not out:
        raise SystemExit("--dtype: empty list")
    return out


def run(args: argparse.Namespace) -> int:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model_dir = Path(args.model) if args.model else preset_model(args.cache_dir)
    batches = [int(b) for b in args.batch_sizes.split(",") if b]
    device = getattr(args, "device", "cpu")
    dtypes = parse_dtypes(args.dtype, device)
    rows: list[dict[str, Any]] = []
    limits: dict[str, dict[str, Any]] = {}
    for dtype in dtypes:
        if args.limits:
            from pdserve.bench.limits import measure_limits

            limits[dtype] = measure_limits(dtype, repeats=max(3, args.repeats), clock=clock)
        rows += bench_dtype(args, model_dir, dtype, batches, clock)
        if args.compare_unpacked:
            rows += bench_dtype(args, model_dir, dtype, batches, clock, packed=False)
        if args.limits:
            add_fractions(rows, limits[dtype], model_dir, dtype, args.prompt_len, args.gen_len)
    print_table(rows, model_dir, args.prompt_len, args.gen_len, torch.get_num_threads(), args.clock)
    if limits:
        print_limits(rows, limits)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(
            json.dumps(
                {
                    "model": str(model_dir),
                    "prompt_len": args.prompt_len,
                    "gen_len": args.gen_len,
                    "clock": args.clock,
                    "device": device,
                    "threads": torch.get_num_threads(),
                    "dtypes": dtypes,
                    "limits": limits,
                    "rows": rows,
                },
                indent=2,
            )
        )
    return 0


def bench_dtype(
    args: argparse.Namespace,
    model_dir: Path,
    dtype: str,
    batches: list[int],
    clock: Any,
    packed: bool = True,
) -> list[dict[str, Any]]:
    """Rows of one dtype: ours and transformers in `dtype`, interleaved per repeat. packed=False
    builds the engine with PDSERVE_PACK_WEIGHTS=0 (plain F.linear weights). With
    args.compare_variant a batch-variant engine runs in the same loop (rows marked
    invariant=False)."""
    import os

    import torch

    max_b, plen, glen = max(batches), args.prompt_len, args.gen_len
    device = getattr(args, "device", "cpu")
    old = os.environ.get("PDSERVE_PACK_WEIGHTS")
    os.environ["PDSERVE_PACK_WEIGHTS"] = "1" if packed else "0"
    try:
        engines = {True: _engine(model_dir, dtype, max_b, plen, glen, device=device)}
        if getattr(args, "compare_variant", False):
            engines[False] = _engine(
                model_dir, dtype, max_b, plen, glen, invariant=False, device=device
            )
    finally:
        if old is None:
            del os.environ["PDSERVE_PACK_WEIGHTS"]
        else:
            os.environ["PDSERVE_PACK_WEIGHTS"] = old
    vocab = engines[True].vocab_size
    hf = None
    if not args.no_hf:
        import transformers

        hf = (
            transformers.AutoModelForCausalLM.from_pretrained(
                model_dir, dtype=getattr(torch, dtype)
            )
            .to(device)
            .eval()
        )
    warm = _prompts(2, 16, vocab, seed=99)
    for engine in engines.values():
        bench_ours(engine, warm, 4)
    if hf is not None:
        bench_hf(hf, warm, 4)

    rows = []
    for b in batches:
        prompts = _prompts(b, plen, vocab, seed=b)
        ours: dict[bool, list[tuple[float, float]]] = {k: [] for k in engines}
        ref = []
        for _ in range(args.repeats):  # interleaved, so all see the same machine load
            for inv, engine in engines.items():
                ours[inv].append(bench_ours(engine, prompts, glen, clock))
            if hf is not None:
                ref.append(bench_hf(hf, prompts, glen, clock))
        for inv, times in ours.items():
            # best of N per phase: the least disturbed run on a shared machine
            row: dict[str, Any] = {
                "dtype": dtype,
                "packed": packed,
                "invariant": inv,
                "batch": b,
                "ours_prefill_tok_s": b * plen / min(t[0] for t in times),
                "ours_decode_tok_s": b * (glen - 1) / min(t[1] for t in times),
                "ours_prefill_s_all": [t[0] for t in times],
                "ours_decode_s_all": [t[1] for t in times],
            }
            if ref:
                row["hf_prefill_tok_s"] = b * plen / min(t[0] for t in ref)
                decodes = [t[1] for t in ref if t[1] == t[1]]  # drop NaN (not measurable)
                if decodes:
                    row["hf_decode_tok_s"] = b * (glen - 1) / min(decodes)
            rows.append(row)
            print(f"  {_label(row)} batch {b}: done", flush=True)
    return rows


def _label(row: dict[str, Any]) -> str:
    label = row["dtype"] + ("" if row.get("packed", True) else "/plain")
    return label + ("" if row.get("invariant", True) else "/variant")


def _engine(
    model_dir: Path,
    dtype: str,
    max_b: int,
    plen: int,
    glen: int,
    invariant: bool = True,
    device: str = "cpu",
) -> Any:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model_dir,
            dtype=dtype,
            device=device,
            num_blocks=max_b * (-(-(plen + glen) // 16)) + 8,
            max_num_batched_tokens=max(2048, max_b * plen),
            max_num_seqs=max_b,
            enable_prefix_caching=False,  # every run recomputes its prompts
            batch_invariant=invariant,
        )
    )


def add_fractions(
    rows: list[dict[str, Any]],
    limits: dict[str, Any],
    model_dir: Path,
    dtype: str,
    plen: int,
    glen: int,
) -> None:
    """Per row of `dtype`: achieved prefill FLOP/s and decode bytes/s, and their fractions."""
    from pdserve.bench import limits as lim
    from pdserve.model.config import ModelConfig

    cost = lim.ModelCost.of(ModelConfig.from_dir(model_dir), dtype)
    for r in rows:
        if r["dtype"] != dtype:
            continue
        b = r["batch"]
        prefill_s = b * plen / r["ours_prefill_tok_s"]
        decode_s = b * (glen - 1) / r["ours_decode_tok_s"]
        r["prefill_flops_s"] = lim.prefill_flops(cost, [plen] * b) / prefill_s
        r["decode_bytes_s"] = lim.decode_phase_bytes(cost, b, plen, glen - 1) / decode_s
        r["decode_flops_s"] = lim.decode_phase_flops(cost, b, plen, glen - 1) / decode_s
        frac = lim.achieved_fraction(
            limits,
            prefill_flops_s=r["prefill_flops_s"],
            decode_bytes_s=r["decode_bytes_s"],
            decode_flops_s=r["decode_flops_s"],
        )
        r["prefill_fraction"], r["decode_fraction"] = frac["prefill"], frac["decode"]
        r["decode_roofline_fraction"] = frac["decode_roofline"]


def print_table(
    rows: list[dict], model_dir: Path, plen: int, glen: int, threads: int, clock: str
) -> None:
    print(f"model {model_dir}  prompt_len {plen}  gen_len {glen}  threads {threads}  clock {clock}")
    head = f"{'dtype':>14} {'batch':>5} | {'prefill tok/s':>13} {'hf':>9} {'ratio':>6} | "
    head += f"{'decode tok/s':>12} {'hf':>9} {'ratio':>6}"
    print(head)
    print("-" * len(head))
    for r in rows:
        hp, hd = r.get("hf_prefill_tok_s"), r.get("hf_decode_tok_s")
        line = f"{_label(r):>14} {r['batch']:>5} | {r['ours_prefill_tok_s']:>13.0f} "
        line += (
            f"{hp:>9.0f} {r['ours_prefill_tok_s'] / hp:>5.2f}x | "
            if hp
            else f"{'-':>9} {'-':>6} | "
        )
        line += f"{r['ours_decode_tok_s']:>12.0f} "
        line += f"{hd:>9.0f} {r['ours_decode_tok_s'] / hd:>5.2f}x" if hd else f"{'-':>9} {'-':>6}"
        print(line)
    for label in dict.fromkeys(_label(r) for r in rows):
        mine = [r for r in rows if _label(r) == label]
        if len(mine) > 1 and mine[0]["batch"] == 1:
            scale = mine[-1]["ours_decode_tok_s"] / mine[0]["ours_decode_tok_s"]
            print(f"{label} decode scaling batch {mine[-1]['batch']} / batch 1: {scale:.1f}x")
    by = {(_label(r), r["batch"]): r for r in rows}
    # other dtype vs float32 (same path), then prepacked vs plain weights (same dtype)
    pairs = [
        ((lab, b), ("float32" + lab[len(lab.split("/")[0]) :], b))
        for lab, b in by
        if not lab.startswith("float32")
    ]
    pairs += [((lab, b), (lab + "/plain", b)) for lab, b in by if "/" not in lab]
    # the cost of batch invariance: invariant (default) vs variant, same dtype and weights
    pairs += [((lab, b), (lab + "/variant", b)) for lab, b in by if not lab.endswith("/variant")]
    for key, base_key in pairs:
        r, base = by[key], by.get(base_key)
        if base is None:
            continue
        line = f"{key[0]} / {base_key[0]}, batch {key[1]}: ours prefill "
        line += f"{r['ours_prefill_tok_s'] / base['ours_prefill_tok_s']:.2f}x decode "
        line += f"{r['ours_decode_tok_s'] / base['ours_decode_tok_s']:.2f}x"
        if "hf_prefill_tok_s" in r and "hf_prefill_tok_s" in base:
            line += f"; hf prefill {r['hf_prefill_tok_s'] / base['hf_prefill_tok_s']:.2f}x"
        if "hf_decode_tok_s" in r and "hf_decode_tok_s" in base:
            line += f" decode {r['hf_decode_tok_s'] / base['hf_decode_tok_s']:.2f}x"
        print(line)


def print_limits(rows: list[dict], limits: dict[str, dict[str, Any]]) -> None:
    from pdserve.bench.limits import format_limits

    for lim in limits.values():
        print(format_limits(lim))
    head = f"{'dtype':>14} {'batch':>5} | {'prefill GFLOP/s':>15} {'of peak':>7} | "
    head += f"{'decode GB/s':>11} {'of bw':>6} {'GFLOP/s':>8} {'roofline':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        if "prefill_fraction" not in r:
            continue
        print(
            f"{_label(r):>14} {r['batch']:>5} | {r['prefill_flops_s'] / 1e9:>15.1f} "
            f"{r['prefill_fraction']:>7.0%} | {r['decode_bytes_s'] / 1e9:>11.2f} "
            f"{r['decode_fraction']:>6.0%} {r['decode_flops_s'] / 1e9:>8.1f} "
            f"{r['decode_roofline_fraction']:>8.0%}"
        )
    print(
        "of peak: prefill FLOP/s / GEMM peak; of bw: decode weight+KV bytes/s / read bandwidth;"
        " roofline: max(of bw, decode FLOP/s / GEMM peak)"
    )
