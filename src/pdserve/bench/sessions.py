"""Multi-turn chat sessions as token ids, for the KV-reuse benchmark.

Session s, turn 1: a random prompt of `first_len` tokens. Turn k > 1: the previous prompt +
the previous answer + `user_len` new random tokens, so turn k's prompt extends turn k-1's
conversation exactly (what the kvstore and prefix cache can reuse). Between turns the session
"thinks" for an exponential time (seeded). Sessions run concurrently; each turn is a
RequestRecord with `session_id` and `turn` set.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.bench.loadgen import StreamingClient, send_one
from pdserve.workload.metrics import RequestRecord, stats_ms
from pdserve.workload.requests import BenchRequest, random_tokens


@dataclass(frozen=True)
class SessionPlan:
    num_sessions: int = 8
    turns: int = 4
    first_len: int = 256
    user_len: int = 64
    output_len: int = 32
    think_time_s: float = 1.0  # mean of the exponential pause between turns
    ramp_s: float = 2.0  # session starts are uniform in [0, ramp_s)
    vocab_size: int = 1000
    max_model_len: int | None = None
    seed: int = 0


def session_rng(plan: SessionPlan, s: int) -> np.random.Generator:
    return np.random.default_rng([plan.seed, 5, s])


async def run_session(
    client: StreamingClient, plan: SessionPlan, s: int, t0: float, temperature: float = 0.0
) -> list[RequestRecord]:
    rng = session_rng(plan, s)
    start = float(rng.uniform(0, plan.ramp_s)) if plan.ramp_s > 0 else 0.0
    await asyncio.sleep(max(0.0, t0 + start - time.perf_counter()))
    sid = f"bench-{plan.seed}-{s}"
    history: list[int] = []
    records = []
    for turn in range(1, plan.turns + 1):
        new = random_tokens(rng, plan.first_len if turn == 1 else plan.user_len, plan.vocab_size)
        prompt = history + new
        if plan.max_model_len and len(prompt) + plan.output_len > plan.max_model_len:
            break  # the conversation no longer fits the context: the session ends
        answer: list[int] = []
        req = BenchRequest(s * 1000 + turn, prompt, plan.output_len, session_id=sid)
        rec = await send_one(
            client,
            req,
            t0,
            temperature=temperature,
            arrival_s=time.perf_counter() - t0,
            collect=answer,
        )
        rec.turn = turn
        records.append(rec)
        if not rec.ok:
            break
        history = prompt + answer
        if turn < plan.turns and plan.think_time_s > 0:
            await asyncio.sleep(float(rng.exponential(plan.think_time_s)))
    return records


async def run_sessions(
    client: StreamingClient, plan: SessionPlan, temperature: float = 0.0, progress: bool = True
) -> tuple[list[RequestRecord], float]:
    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    bar = tqdm(total=plan.num_sessions, desc="sessions", unit="session", disable=not progress)
    tasks = [
        asyncio.create_task(run_session(client, plan, s, t0, temperature))
        for s in range(plan.num_sessions)
    ]
    for t in tasks:
        t.add_done_callback(lambda _: bar.update(1))
    try:
        per = await asyncio.gather(*tasks)
    finally:
        bar.close()
    return [r for recs in per for r in recs], time.perf_counter() - t0


def turn_report(records: Sequence[RequestRecord]) -> dict[str, Any]:
    """Hit rate (cached / prompt tokens) and TTFT of turns 2+, plus turn 1 for contrast."""

    def part(recs: Sequence[RequestRecord]) -> dict[str, Any]:
        done = [r for r in recs if r.ok]
        prompt = sum(r.n_in for r in done)
        cached = sum(r.cached_tokens for r in done)
        return {
            "turns": len(recs),
            "failed": len(recs) - len(done),
            "prompt_tokens": prompt,
            "cached_tokens": cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_ms": stats_ms(r.ttft_s for r in done),
        }

    return {
        "turn1": part([r for r in records if r.turn == 1]),
        "turns2plus": part([r for r in records if r.turn >= 2]),
    }
