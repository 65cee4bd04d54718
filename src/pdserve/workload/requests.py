"""Workloads: what each benchmark request sends (prompt token ids, max_tokens).

Prompts are random token ids from seeded generators, so a workload is a pure function of its
arguments. Mooncake hash ids map to fixed runs of tokens (seeded by the id): two requests that
share a prefix of hash ids share exactly that token prefix, which is what prefix caching and the
kvstore can reuse. Every request runs with ignore_eos and max_tokens = its output length.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from pdserve.workload.traces import MOONCAKE_BLOCK_TOKENS, TraceRecord

TOKEN_LO = 10  # random ids start here: keeps clear of the usual special tokens (bos/eos/pad)


@dataclass
class BenchRequest:
    index: int
    prompt_ids: list[int]
    max_tokens: int
    arrival_s: float = 0.0  # offset from the start of the run
    session_id: str | None = None
    hash_ids: tuple[int, ...] = field(default=())
    prompt_text: str | None = None  # sent as text instead of prompt_ids (length workload)
    oracle_tokens: int = 0  # the true output length (read only by an oracle-mode router)


@dataclass(frozen=True)
class LengthDist:
    """fixed:N | uniform:LO,HI | lognormal:MEAN,SIGMA (MEAN of the lengths, SIGMA of log)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        kind, _, rest = spec.partition(":")
        parts = [p for p in rest.replace(":", ",").split(",") if p]
        try:
            nums = [float(p) for p in parts]
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}: non-numeric value") from None
        if kind == "fixed" and len(nums) == 1 and nums[0] >= 1:
            return cls("fixed", nums[0])
        if kind == "uniform" and len(nums) == 2 and 1 <= nums[0] <= nums[1]:
            return cls("uniform", nums[0], nums[1])
        if kind == "lognormal" and len(nums) == 2 and nums[0] >= 1 and nums[1] >= 0:
            return cls("lognormal", nums[0], nums[1])
        raise ValueError(
            f"bad length distribution {spec!r}: use fixed:N, uniform:LO,HI or lognormal:MEAN,SIGMA"
        )

    def sample(self, n: int, rng: np.random.Generator) -> list[int]:
        if self.kind == "fixed":
            vals = np.full(n, self.a)
        elif self.kind == "uniform":
            vals = rng.integers(int(self.a), int(self.b) + 1, size=n)
        else:
            mu = math.log(self.a) - self.b**2 / 2.0  # so that E[length] = a
            vals = rng.lognormal(mu, self.b, size=n)
        return [max(1, round(float(v))) for v in vals]


def clip_lengths(n_in: int, n_out: int, max_model_len: int | None) -> tuple[int, int]:
    """Keep prompt + output inside the context: the output is capped at half the context
    (>= 1), then the prompt takes what is left."""
    n_in, n_out = max(1, n_in), max(1, n_out)
    if max_model_len is None:
        return n_in, n_out
    n_out = min(n_out, max(1, max_model_len // 2), max_model_len - 1)
    n_in = min(n_in, max_model_len - n_out)
    return max(1, n_in), n_out


def scale_len(n: int, factor: float) -> int:
    return max(1, round(n * factor))


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    if vocab_size <= TOKEN_LO:
        raise ValueError(f"vocab_size must be > {TOKEN_LO}, got {vocab_size}")
    return rng.integers(TOKEN_LO, vocab_size, size=n).tolist()


def synthetic_requests(
    n: int,
    input_dist: LengthDist,
    output_dist: LengthDist,
    vocab_size: int,
    seed: int = 0,
    max_model_len: int | None = None,
) -> list[BenchRequest]:
    """`n` requests; request i depends only on (seed, i), so a longer run extends a shorter
    one with the same seed (a duration-bounded run at a higher rate just adds requests)."""
    reqs = []
    for i in range(n):
        rng = np.random.default_rng([seed, 1, i])
        n_in, n_out = input_dist.sample(1, rng)[0], output_dist.sample(1, rng)[0]
        n_in, n_out = clip_lengths(n_in, n_out, max_model_len)
        reqs.append(BenchRequest(i, random_tokens(rng, n_in, vocab_size), n_out))
    return reqs


def mooncake_block_tokens(length_scale: float, kv_block_size: int) -> int:
    """Tokens one hash id stands for after scaling: a whole number of KV blocks (>= 1)."""
    blocks = max(1, round(MOONCAKE_BLOCK_TOKENS * length_scale / kv_block_size))
    return blocks * kv_block_size


def hash_id_tokens(hash_id: int, n_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The fixed run of tokens of one Mooncake hash id (a pure function of id and seed)."""
    return random_tokens(np.random.default_rng([seed, 2, hash_id]), n_tokens, vocab_size)


def mooncake_prompt(
    hash_ids: Sequence[int],
    n_in: int,
    block_tokens: int,
    vocab_size: int,
    seed: int = 0,
    pad_rng: np.random.Generator | None = None,
) -> list[int]:
    """Concatenate the hash ids' token runs, cut to `n_in`; pad with fresh random tokens
    when the ids cover fewer than `n_in` tokens."""
    ids: list[int] = []
    for h in hash_ids:
        if len(ids) >= n_in:
            break
        ids.extend(hash_id_tokens(h, block_tokens, vocab_size, seed))
    if len(ids) < n_in:
        rng = pad_rng if pad_rng is not None else np.random.default_rng([seed, 3, n_in])
        ids.extend(random_tokens(rng, n_in - len(ids), vocab_size))
    return ids[:n_in]


def trace_requests(
    records: Sequence[TraceRecord],
    vocab_size: int,
    seed: int = 0,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    kv_block_size: int = 16,
) -> list[BenchRequest]:
    """One request per trace record; lengths scaled then clipped; arrival = trace timestamp.
    Records with hash ids (Mooncake) get prefix-sharing prompts."""
    return list(
        iter_trace_requests(records, vocab_size, seed, length_scale, max_model_len, kv_block_size)
    )


def iter_trace_requests(
    records: Sequence[TraceRecord],
    vocab_size: int,
    seed: int = 0,
    length_scale: float = 1.0,
    max_model_len: int | None = None,
    kv_block_size: int = 16,
) -> Iterator[BenchRequest]:
    """`trace_requests` one at a time: the prompts come from one generator drawn in trace
    order, so the first n requests are the same however many are drawn."""
    rng = np.random.default_rng([seed, 4])
    block_tokens = mooncake_block_tokens(length_scale, kv_block_size)
    for i, rec in enumerate(records):
        n_in, n_out = clip_lengths(
            scale_len(rec.input_len, length_scale),
            scale_len(rec.output_len, length_scale),
            max_model_len,
        )
        if rec.hash_ids:
            prompt = mooncake_prompt(rec.hash_ids, n_in, block_tokens, vocab_size, seed, rng)
        else:
            prompt = random_tokens(rng, n_in, vocab_size)
        yield BenchRequest(i, prompt, n_out, rec.timestamp_s, hash_ids=rec.hash_ids)


def greedy_and_seeded_streams(n: int, max_tokens: int, vocab: int, seed: int) -> list[dict]:
    """SDK `generate` arguments for token-exactness checks: distinct prompts of 8-48 ids,
    ignore_eos; even streams greedy, odd ones seeded top-p sampling (seed 1000*seed + i)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        req = {
            "token_ids": [rng.randint(2, vocab - 1) for _ in range(rng.randint(8, 48))],
            "max_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
        }
        if i % 2:
            req.update(temperature=0.9, top_p=0.95, seed=1000 * seed + i)
        out.append(req)
    return out
