"""`pdserve generate`: one request, either in-process (--model DIR: the reference path, no
services) or against a running cluster (--addr HOST:PORT, through the SDK)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from pdserve.errors import InvalidRequestError, PdserveError

EXIT_INVALID = 2


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("generate", help="generate from one prompt")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--model", help="checkpoint directory: run an in-process engine")
    where.add_argument(
        "--addr", help="router HOST:PORT, or several replicas a:1,b:2: call a running cluster"
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    what.add_argument("--prompt-ids", help="prompt as comma-separated token ids: 1,2,3")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--session", default=None, help="session id (with --addr)")
    p.add_argument(
        "--api-key", default=None, help="API key (with --addr; default $PDSERVE_CLIENT_API_KEY)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument(
        "--dtype",
        default=os.environ.get("PDSERVE_DTYPE", "auto"),
        choices=["auto", "float32", "bfloat16"],
        help="weights/KV dtype (default: $PDSERVE_DTYPE, else auto = bfloat16 where faster)",
    )
    p.add_argument(
        "--no-batch-invariant",
        dest="batch_invariant",
        action="store_false",
        help="with --model: the batch-variant path (see docs/studies/batch-invariance.md)",
    )
    p.set_defaults(func=run)


def parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise InvalidRequestError(
            "prompt_ids", f"must be comma-separated integers, got {text!r}"
        ) from None


def run(args: argparse.Namespace) -> int:
    try:
        result = run_remote(args) if args.addr else run_local(args)
    except InvalidRequestError as exc:
        print(f"error: invalid {exc}", file=sys.stderr)
        return EXIT_INVALID
    except PdserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the SDK's typed errors: one line, never a traceback
        from pdserve.client import InvalidArgument, PdserveClientError, Unavailable

        if isinstance(exc, InvalidArgument):
            print(f"error: invalid {exc.message}", file=sys.stderr)
            return EXIT_INVALID
        if isinstance(exc, Unavailable):  # router down, or no worker it needs
            print(f"error: Unavailable (router {args.addr}): {exc.message}", file=sys.stderr)
            return 1
        if isinstance(exc, PdserveClientError):
            print(f"error: {type(exc).__name__}: {exc.message}", file=sys.stderr)
            return 1
        raise
    if args.json:
        print(json.dumps(result))
    else:
        print(result["text"] if result["text"] else " ".join(map(str, result["token_ids"])))
    return 0


def run_local(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.params import SamplingParams, validate_params

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    validate_params(params)  # before the (slow) model load
    prompt_ids = parse_ids(args.prompt_ids) if args.prompt_ids is not None else None
    invariant = getattr(args, "batch_invariant", True)
    engine = LLMEngine(
        EngineConfig(args.model, dtype=args.dtype, max_num_seqs=1, batch_invariant=invariant)
    )
    tokenizer = _tokenizer(engine)
    if prompt_ids is None:
        if tokenizer is None:
            raise InvalidRequestError("prompt", "this model has no tokenizer: use --prompt-ids")
        prompt_ids = tokenizer.encode(args.prompt)

    # The router's detokenizer, fed as the router feeds it: the same text for the same tokens.
    detok = tokenizer.detokenizer() if tokenizer is not None else None
    start = time.perf_counter()
    engine.add_request("cli", prompt_ids, params)
    token_ids: list[int] = []
    times: list[float] = []
    reason, cached = None, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_ids += out.new_token_ids
            times += [time.perf_counter()] * len(out.new_token_ids)
            reason, cached = out.finish_reason, out.num_cached_tokens
            if detok is not None:
                detok.add(out.new_token_ids)
    if detok is not None:
        detok.flush()
    end = time.perf_counter()
    ttft = (times[0] - start) * 1e3 if times else 0.0
    tpot = (times[-1] - times[0]) * 1e3 / (len(times) - 1) if len(times) > 1 else 0.0
    return {
        "token_ids": token_ids,
        "text": detok.text if detok is not None else "",
        "finish_reason": reason,
        "prompt_tokens": len(prompt_ids),
        "cached_tokens": cached,
        "ttft_ms": ttft,
        "tpot_ms": tpot,
        "e2e_ms": (end - start) * 1e3,
        "dtype": engine.dtype,  # resolved: what ran (never "auto")
    }


def _tokenizer(engine: Any) -> Any:
    try:
        return engine.loaded.tokenizer
    except Exception:  # no tokenizer.json: ids in, ids out
        return None


def run_remote(args: argparse.Namespace) -> dict[str, Any]:
    from pdserve.client import Client

    kwargs: dict[str, Any] = dict(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        session_id=args.session,
    )
    if args.prompt_ids is not None:
        kwargs["token_ids"] = parse_ids(args.prompt_ids)
    else:
        kwargs["prompt"] = args.prompt
    with Client(args.addr, api_key=args.api_key) as client:
        r = client.generate(**kwargs)
        usage = r.usage
        served_by = (usage.decode_instance or usage.prefill_instance) if usage else ""
        dtype = _served_dtype(client, served_by)
    return {
        "token_ids": list(r.token_ids),
        "text": r.text,
        "finish_reason": r.finish_reason,
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "ttft_ms": r.ttft_ms,
        "tpot_ms": r.tpot_ms,
        "e2e_ms": r.e2e_ms,
        "dtype": dtype,
    }


def _served_dtype(client: Any, instance_id: str) -> str:
    """The dtype of the worker that produced the tokens (from the router's Status), else
    what the cluster serves; "" when the router cannot say."""
    try:
        status = client.status(timeout=5.0)
    except Exception:  # the tokens are what matters; the dtype is a label
        return ""
    for inst in status.instances:
        if inst.instance_id == instance_id and inst.dtype:
            return inst.dtype
    return status.dtype
