"""The workload a run's flags describe (`--trace`, `--input-len`, `--rate`, ...): the
requests with their arrival times, the same for `bench serve`, `sim` and `plan`."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.workload import arrivals
from pdserve.workload.requests import BenchRequest, LengthDist, synthetic_requests, trace_requests
from pdserve.workload.traces import read_trace


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """Workload, arrival and SLO flags shared by serve and compare."""
    g = p.add_argument_group("workload")
    g.add_argument("--model", help="checkpoint dir: vocab size and context length from config.json")
    g.add_argument("--vocab-size", type=int, help="random token ids are drawn below this")
    g.add_argument("--max-model-len", type=int, help="clip prompt + output to this context")
    g.add_argument("--block-size", type=int, default=16, help="KV block size (Mooncake prefixes)")
    g.add_argument("--trace", help="Azure CSV or Mooncake JSONL trace (read in place)")
    g.add_argument("--trace-format", default="auto", choices=["auto", "azure", "mooncake"])
    g.add_argument(
        "--trace-offset", type=int, default=0, help="skip the trace's first N requests (a window)"
    )
    g.add_argument(
        "--length-scale", type=float, default=1.0, help="scale trace (or --lengths) lengths"
    )
    g.add_argument(
        "--lengths",
        help="length data JSONL(.gz) (pdserve predictor format): real prompts sent as text, "
        "max_tokens = --lengths-model's answer length x --length-scale, ignore_eos",
    )
    g.add_argument("--lengths-model", default="gpt-4-0613", help="whose answer lengths ('any')")
    g.add_argument("--lengths-split", default="val", help="prompt_split to draw from ('' = all)")
    g.add_argument("--max-prompt-chars", type=int, default=1500, help="--lengths: cut prompts")
    g.add_argument("--input-len", default="lognormal:256,0.5", help="synthetic input lengths")
    g.add_argument("--output-len", default="uniform:32,128", help="synthetic output lengths")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    a = p.add_argument_group("arrivals")
    a.add_argument("--rate", type=float, help="req/s (default 1 synthetic; trace: its own times)")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument("--time-scale", type=float, default=1.0, help="trace replay: stretch time")
    a.add_argument("--num-requests", type=int, help="number of requests (default 100)")
    a.add_argument(
        "--clock-scale",
        type=float,
        default=1.0,
        help="the cluster is emulated with --time-scale X: stretch arrivals by X and report "
        "every time divided by X (modelled time)",
    )
    a.add_argument("--duration", type=float, help="seconds of arrivals instead of a count")
    s = p.add_argument_group("SLOs and goodput")
    s.add_argument(
        "--goodput",
        nargs="*",
        default=[],
        metavar="KEY:MS",
        help="SLOs in ms, e.g. ttft:500 tpot:50 e2e:5000",
    )
    s.add_argument("--sweep-rates", help="comma-separated rates, or 'auto' (bracket + bisect)")
    s.add_argument(
        "--sweep-start", type=float, default=1.0, help="first rate of --sweep-rates auto"
    )
    s.add_argument("--target", type=float, default=0.9, help="DistServe attainment target")
    p.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="unmeasured requests sent one by one before the first run",
    )
    p.add_argument("--no-progress", action="store_true")


def model_limits(args: argparse.Namespace) -> tuple[int, int | None]:
    """(vocab_size, max_model_len) from the flags, else the model's config.json, else defaults."""
    vocab, max_len = args.vocab_size, args.max_model_len
    if args.model:
        cfg = json.loads((Path(args.model) / "config.json").read_text())
        vocab = vocab or cfg.get("vocab_size")
        max_len = max_len or cfg.get("max_position_embeddings")
    return int(vocab or 1000), max_len


WARMUP_SALT = 1000  # the warm-up's prompts differ from every run's


def prompt_seed(args: argparse.Namespace, salt: int) -> int:
    """The seed of run `salt`'s prompt tokens. Every run of a sweep (and the warm-up) gets
    its own prompts: re-sending the same ones would hit the prefix cache of the run before."""
    return args.seed + 7919 * salt


def trace_window(args: argparse.Namespace) -> list[Any]:
    """The trace's records from `--trace-offset` on, at most `--num-requests` of them."""
    skip = getattr(args, "trace_offset", 0) or 0
    if skip < 0:
        raise ValueError(f"--trace-offset must be >= 0, got {skip}")
    limit = skip + args.num_requests if args.num_requests else None
    return read_trace(args.trace, args.trace_format, limit=limit)[skip:]


def base_requests(
    args: argparse.Namespace, n_hint: int | None = None, salt: int = 0
) -> list[BenchRequest]:
    """The workload before arrivals are assigned (trace requests keep the trace's times)."""
    vocab, max_len = model_limits(args)
    seed = prompt_seed(args, salt)
    if getattr(args, "lengths", None):
        from pdserve.workload.lengths import length_requests

        n = n_hint if n_hint is not None else (args.num_requests or 100)
        max_out = max(1, max_len // 2) if max_len else None
        return length_requests(
            args.lengths,
            args.lengths_model,
            n,
            split=args.lengths_split,
            scale=args.length_scale,
            seed=seed,
            max_prompt_chars=args.max_prompt_chars,
            max_output=max_out,
        )
    if args.trace:
        records = trace_window(args)
        return trace_requests(records, vocab, seed, args.length_scale, max_len, args.block_size)
    n = n_hint if n_hint is not None else (args.num_requests or 100)
    return synthetic_requests(
        n, LengthDist.parse(args.input_len), LengthDist.parse(args.output_len), vocab, seed, max_len
    )


def workload_at(
    args: argparse.Namespace,
    rate: float | None,
    salt: int = 0,
    base: list[BenchRequest] | None = None,
) -> list[BenchRequest]:
    """Requests with arrival times for one run at `rate` (None: the default rate). `base`:
    the trace's `base_requests(args, salt=salt)` when the caller already has them (the
    simulator replays one trace at many rates)."""
    if args.trace:
        reqs = base if base is not None else base_requests(args, salt=salt)
        stamps = [r.arrival_s for r in reqs]
        if rate is not None and args.duration:
            # rescale the window actually replayed, not the whole file
            n, times = arrivals.replay_window(stamps, rate, args.duration)
            reqs = reqs[:n]
        else:
            times = arrivals.replay_arrivals(stamps, args.time_scale, rate)
        out = [replace(r, arrival_s=t) for r, t in zip(reqs, times, strict=True)]
        if args.duration:
            out = [r for r in out if r.arrival_s < args.duration]
        return out
    rate = rate or args.rate or 1.0
    if args.duration:
        times = arrivals.arrivals_for_duration(args.duration, rate, args.burstiness, args.seed)
    else:
        times = arrivals.gamma_arrivals(args.num_requests or 100, rate, args.burstiness, args.seed)
    reqs = base_requests(args, n_hint=len(times), salt=salt)
    return [replace(r, arrival_s=t) for r, t in zip(reqs, times, strict=True)]


def offered_rate(reqs: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    """What was actually offered: n requests, their mean rate (n - 1) / span and, for a
    duration-bounded run, n / duration. Recorded with every run so a label cannot lie."""
    times = sorted(r.arrival_s for r in reqs)
    duration = getattr(args, "duration", None)
    return {
        "num_requests": len(times),
        "span_s": (times[-1] - times[0]) if times else 0.0,
        "mean_rate_req_s": arrivals.mean_rate(times),
        "per_duration_req_s": (len(times) / duration) if duration else None,
    }
