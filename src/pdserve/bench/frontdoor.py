"""`pdserve bench frontdoor`: the OpenAI HTTP front door vs the gRPC one, same cluster, same
requests, in one run.

Starts one cluster (router with --http-port; default 1 colocated worker so the workers add
as little noise as possible), then alternates the two doors request by request (round by
round for the concurrent phase), so load drift hits both equally:
- request overhead: `--requests` sequential requests of 1 output token (E2E = the front
  door's per-request cost + one prefill);
- streaming: `--rounds` rounds of `--concurrency` concurrent streams of `--max-tokens`
  tokens (ignore_eos); TPOT per stream = (last chunk - first chunk) / (chunks - 1), measured
  by the client on arrival.
Clients: the pdserve AsyncClient (gRPC) and raw httpx SSE (no SDK parsing on the HTTP side).
Prints a table and writes JSON with every sample (`--out`).

`--load N` instead loads a RUNNING cluster (`--addr`, `--http-url`) with N concurrent streams
per door as a user sends them (the openai client, the SDK) and reports every failure by kind
(bench/doorload.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (default: the built-in tiny model)")
    p.add_argument("--mode", choices=["colocated", "disagg"], default="colocated")
    p.add_argument("--requests", type=int, default=40, help="sequential 1-token requests/door")
    p.add_argument("--rounds", type=int, default=6, help="streaming rounds per door")
    p.add_argument("--concurrency", type=int, default=8, help="streams per round")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per stream")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write all samples as JSON here")
    p.add_argument("--worker-arg", action="append", default=[], metavar="FLAG")
    load = p.add_argument_group("load a running cluster (--load N)")
    load.add_argument("--load", type=int, default=0, metavar="N", help="N concurrent streams")
    load.add_argument("--door", choices=["openai", "sdk", "both"], default="both")
    load.add_argument("--addr", help="the router's gRPC HOST:PORT (--door sdk)")
    load.add_argument("--http-url", help="the router's OpenAI base URL, .../v1 (--door openai)")
    load.add_argument(
        "--retries", type=int, default=0, help="client retries (0: count every error)"
    )
    load.add_argument("--api-key", default="", help="API key, when the router asks for one")


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("frontdoor", help="OpenAI HTTP vs gRPC front door overhead")
    add_arguments(p)
    p.set_defaults(func=run)


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(n)]


async def _grpc_stream(client, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    arrivals = []
    async for ev in client.generate_stream(
        token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
    ):
        arrivals += [time.perf_counter()] * max(1, len(ev.token_ids))
    return t0, arrivals


async def _http_stream(http, prompt: list[int], max_tokens: int) -> tuple[float, list[float]]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    t0 = time.perf_counter()
    arrivals: list[float] = []
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            n = sum(len(c.get("token_ids", [])) for c in chunk.get("choices", []))
            arrivals += [time.perf_counter()] * n
    return t0, arrivals


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (Linux /proc), seconds."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _tpot(arrivals: list[float]) -> float | None:
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) if len(arrivals) > 1 else None


async def _measure(
    args, grpc_addr: str, http_url: str, vocab: int, router_pid: int
) -> dict[str, Any]:
    import httpx

    from pdserve.client import AsyncClient

    rng = random.Random(args.seed)
    samples: dict[str, dict[str, list[float]]] = {
        door: {"e2e_1tok_s": [], "ttft_s": [], "tpot_s": [], "stream_e2e_s": []}
        for door in ("grpc", "http")
    }
    cpu = {
        door: {"requests": 0, "tokens": 0, "router_cpu_s": 0.0, "client_cpu_s": 0.0}
        for door in ("grpc", "http")
    }
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with (
        AsyncClient(grpc_addr, max_retries=0) as client,
        httpx.AsyncClient(base_url=http_url, limits=limits, timeout=120.0) as http,
    ):
        doors = {
            "grpc": lambda p, n: _grpc_stream(client, p, n),
            "http": lambda p, n: _http_stream(http, p, n),
        }
        for door in doors:  # warm-up: connections, caches, first-call costs
            await doors[door](_prompt(rng, args.prompt_tokens, vocab), 4)
        order = ["grpc", "http"]
        for i in range(args.requests):
            prompt = _prompt(rng, args.prompt_tokens, vocab)
            for door in order if i % 2 == 0 else order[::-1]:
                c0, k0 = cpu_seconds(router_pid), time.process_time()
                t0, arr = await doors[door](prompt, 1)
                cpu[door]["router_cpu_s"] += cpu_seconds(router_pid) - c0
                cpu[door]["client_cpu_s"] += time.process_time() - k0
                cpu[door]["requests"] += 1
                cpu[door]["tokens"] += len(arr)
                samples[door]["e2e_1tok_s"].append(arr[-1] - t0)
        for r in range(args.rounds):
            prompts = [_prompt(rng, args.prompt_tokens, vocab) for _ in range(args.concurrency)]
            for door in order if r % 2 == 0 else order[::-1]:
                c0, k0 = cpu_seconds(router_pid), time.process_time()
                results = await asyncio.gather(*(doors[door](p, args.max_tokens) for p in prompts))
                cpu[door]["router_cpu_s"] += cpu_seconds(router_pid) - c0
                cpu[door]["client_cpu_s"] += time.process_time() - k0
                cpu[door]["requests"] += len(results)
                cpu[door]["tokens"] += sum(len(arr) for _, arr in results)
                for t0, arr in results:
                    samples[door]["ttft_s"].append(arr[0] - t0)
                    samples[door]["stream_e2e_s"].append(arr[-1] - t0)
                    tpot = _tpot(arr)
                    if tpot is not None:
                        samples[door]["tpot_s"].append(tpot)
    return {"samples": samples, "cpu": cpu}


def summarize(samples: dict[str, dict[str, list[float]]]) -> list[dict[str, Any]]:
    rows = []
    for metric in ("e2e_1tok_s", "ttft_s", "tpot_s", "stream_e2e_s"):
        g = statistics.median(samples["grpc"][metric])
        h = statistics.median(samples["http"][metric])
        rows.append(
            {
                "metric": metric,
                "grpc_ms": g * 1e3,
                "http_ms": h * 1e3,
                "http_minus_grpc_ms": (h - g) * 1e3,
                "http_over_grpc": h / g if g else float("nan"),
                "n": len(samples["grpc"][metric]),
            }
        )
    return rows


def run(args: argparse.Namespace) -> int:
    if args.load:
        return _load(args)
    from pdserve.launcher import Cluster, ClusterConfig
    from pdserve.router.frontdoor.model_info import ModelInfo

    cluster = Cluster(
        ClusterConfig(
            model=args.model,
            mode=args.mode,
            colocated=1,
            prefill=1,
            decode=1,
            port=0,
            http_port=0,
            worker_args=list(args.worker_arg),
        )
    )
    cluster.start()
    try:
        vocab, _ = ModelInfo.from_dir(cluster.model_dir).known_limits
        router_pid = cluster.processes["router"].popen.pid
        http_url = f"http://127.0.0.1:{cluster.http_port}"
        measured = asyncio.run(_measure(args, cluster.addr, http_url, vocab or 512, router_pid))
        samples, cpu = measured["samples"], measured["cpu"]
    finally:
        cluster.stop()
    rows = summarize(samples)
    print(f"front door overhead, medians ({args.mode}, model {cluster.model_dir})")
    print(f"{'metric':<14}{'gRPC ms':>10}{'HTTP ms':>10}{'HTTP-gRPC':>11}{'ratio':>8}{'n':>6}")
    for r in rows:
        print(
            f"{r['metric']:<14}{r['grpc_ms']:>10.2f}{r['http_ms']:>10.2f}"
            f"{r['http_minus_grpc_ms']:>11.2f}{r['http_over_grpc']:>8.3f}{r['n']:>6}"
        )
    print("CPU time (all phases), router process and benchmark client:")
    for door, c in cpu.items():
        print(
            f"  {door:<5} router {c['router_cpu_s'] * 1e3 / c['tokens']:.3f} ms/token  "
            f"client {c['client_cpu_s'] * 1e3 / c['tokens']:.3f} ms/token  "
            f"({c['requests']} requests, {c['tokens']} tokens)"
        )
    if args.out:
        Path(args.out).write_text(
            json.dumps(
                {"args": vars(args) | {"func": None}, "rows": rows, "samples": samples}, indent=1
            )
        )
    return 0


def _load(args: argparse.Namespace) -> int:
    from pdserve.bench import doorload

    rows = asyncio.run(
        doorload.run_load(
            streams=args.load, door=args.door, addr=args.addr, http_url=args.http_url,
            max_tokens=args.max_tokens, retries=args.retries, api_key=args.api_key,
            seed=args.seed,
        )
    )  # fmt: skip
    doorload.print_report(rows)
    if args.out:
        doorload.write_json(args.out, rows, vars(args) | {"func": None})
    return 1 if any(r["failed"] for r in rows) else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench frontdoor")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
