"""`pdserve bench frontdoor --load N`: N concurrent streams through one front door of a
running cluster, as a user would send them, and every failure by kind.

- `--door openai`: the `openai` client's chat completions (`stream=True`) against the
  router's HTTP API; `--door sdk`: the pdserve `AsyncClient`'s `generate_stream` over gRPC;
  `--door both`: one after the other (same prompts).
- Every stream asks for `--max-tokens` tokens with `ignore_eos`, so a stream that succeeds
  ends with exactly that many tokens and finish_reason "length"; anything else is a failure.
- Client retries are off by default (`--retries 0`): every error the server returns counts.

Failures are reported by kind: the HTTP status or gRPC code plus the message with its
variable parts (ids, numbers) masked, so that 1,000 "decode failed on 1 instance(s) ...
within 5 s" errors read as one line with their count. The report (stdout, and `--out` as JSON)
also gives the wall time, the streams' tokens and the client-side TTFT and E2E percentiles.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

_MASK = re.compile(r"[0-9a-f]{8,}|\d+(\.\d+)?")


def failure_kind(status: str, message: str) -> str:
    """`status: message` with ids and numbers masked (one line per kind of failure)."""
    return f"{status}: {_MASK.sub('#', message.strip().splitlines()[0] if message else '')}"[:200]


@dataclass
class DoorResult:
    door: str
    streams: int
    ok: int = 0
    failures: collections.Counter = field(default_factory=collections.Counter)
    tokens: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        def pct(xs: list[float], q: float) -> float | None:
            return round(statistics.quantiles(xs, n=100)[q - 1], 3) if len(xs) > 1 else None

        return {
            "door": self.door,
            "streams": self.streams,
            "ok": self.ok,
            "failed": sum(self.failures.values()),
            "failures": dict(self.failures.most_common()),
            "tokens": self.tokens,
            "wall_s": round(self.wall_s, 2),
            "ttft_p50_s": pct(self.ttft_s, 50),
            "ttft_p99_s": pct(self.ttft_s, 99),
            "e2e_p50_s": pct(self.e2e_s, 50),
            "e2e_p99_s": pct(self.e2e_s, 99),
        }


def _prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = ("harbor", "quiet", "morning", "boats", "grey", "water", "gulls", "story", "END")
    return [" ".join(rng.choice(words) for _ in range(rng.randint(4, 24))) for _ in range(n)]


async def _openai_streams(url: str, prompts: list[str], max_tokens: int, retries: int, key: str):
    """`url`: one base URL, or several (comma-separated, router replicas): stream k goes to
    URL k mod n."""
    import httpx
    import openai

    res = DoorResult("openai", len(prompts))
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    clients = [
        openai.AsyncOpenAI(
            base_url=u,
            api_key=key or "none",
            max_retries=retries,
            http_client=httpx.AsyncClient(
                limits=limits, timeout=httpx.Timeout(600.0, connect=30.0)
            ),
        )
        for u in url.split(",")
    ]

    async def one(k: int, prompt: str) -> None:
        client = clients[k % len(clients)]
        t0 = time.perf_counter()
        n, finish, first = 0, None, 0.0
        try:
            stream = await client.chat.completions.create(
                model=None,  # type: ignore[arg-type] (the router serves one model)
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )
            async for chunk in stream:
                for choice in chunk.choices:
                    got = len(getattr(choice, "token_ids", None) or [])
                    if got and not first:
                        first = time.perf_counter()
                    n += got
                    finish = choice.finish_reason or finish
        except openai.APIStatusError as exc:
            res.failures[failure_kind(f"HTTP {exc.status_code}", exc.message)] += 1
            return
        except openai.APIError as exc:  # an error event inside the stream, a dropped connection
            res.failures[failure_kind(type(exc).__name__, str(exc))] += 1
            return
        _done(res, n, finish, max_tokens, t0, first)

    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(k, p) for k, p in enumerate(prompts)))
        res.wall_s = time.perf_counter() - t0
    finally:
        for client in clients:
            await client.close()
    return res


async def _sdk_streams(addr: str, prompts: list[str], max_tokens: int, retries: int, key: str):
    from pdserve.client import AsyncClient
    from pdserve.client.errors import PdserveClientError

    res = DoorResult("sdk", len(prompts))

    async def one(prompt: str) -> None:
        t0 = time.perf_counter()
        n, finish, first = 0, None, 0.0
        try:
            async for ev in client.generate_stream(
                messages=[{"role": "user", "content": prompt}],
                max_tokens=max_tokens,
                ignore_eos=True,
            ):
                if ev.token_ids and not first:
                    first = time.perf_counter()
                n += len(ev.token_ids)
                finish = ev.finish_reason or finish
        except PdserveClientError as exc:
            res.failures[failure_kind(type(exc).__name__, str(exc))] += 1
            return
        _done(res, n, finish, max_tokens, t0, first)

    async with AsyncClient(addr, max_retries=retries, api_key=key or None) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(p) for p in prompts))
        res.wall_s = time.perf_counter() - t0
    return res


def _done(res: DoorResult, n: int, finish, max_tokens: int, t0: float, first: float) -> None:
    if n != max_tokens or finish != "length":
        res.failures[f"short stream: {n} tokens, finish {finish}"] += 1
        return
    res.ok += 1
    res.tokens += n
    res.e2e_s.append(time.perf_counter() - t0)
    if first:
        res.ttft_s.append(first - t0)


async def run_load(
    *,
    streams: int,
    door: str,
    addr: str | None,
    http_url: str | None,
    max_tokens: int,
    retries: int = 0,
    api_key: str = "",
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Run `streams` concurrent streams through each door asked for; one summary per door."""
    prompts = _prompts(streams, seed)
    out = []
    if door in ("openai", "both"):
        if not http_url:
            raise SystemExit("--door openai needs --http-url (the router's /v1 URL, or several)")
        out.append(await _openai_streams(http_url, prompts, max_tokens, retries, api_key))
    if door in ("sdk", "both"):
        if not addr:
            raise SystemExit("--door sdk needs --addr (the router's gRPC HOST:PORT)")
        out.append(await _sdk_streams(addr, prompts, max_tokens, retries, api_key))
    return [r.summary() for r in out]


def print_report(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        print(
            f"{r['door']:<7} {r['streams']} streams: {r['ok']} ok, {r['failed']} failed, "
            f"{r['tokens']} tokens in {r['wall_s']} s; TTFT p50/p99 {r['ttft_p50_s']}/"
            f"{r['ttft_p99_s']} s, E2E p50/p99 {r['e2e_p50_s']}/{r['e2e_p99_s']} s"
        )
        for kind, n in r["failures"].items():
            print(f"    {n:>6} x {kind}")


def write_json(path: str, rows: list[dict[str, Any]], args: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"args": args, "doors": rows}, f, indent=1)
