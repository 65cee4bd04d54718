"""The output-length predictor's interface: what the router knows about a
request (`LengthQuery`) in, a distribution of its completion length
(`LengthEstimate`: p50 and p90) out, and `learn` told every true length."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthQuery:
    """What the router knows when it must predict. `text` is the prompt as text
    (chat history rendered, if any); `block_hashes` the prompt's chained block
    hashes (a shared prefix shares a leading run); `oracle_tokens` is the true
    length, present only in the benchmark's oracle mode."""

    num_prompt_tokens: int
    max_tokens: int
    model: str = ""
    text: str | None = None
    block_hashes: Sequence[object] = ()
    session_id: str = ""
    oracle_tokens: int = 0


@dataclass(frozen=True)
class LengthEstimate:
    """Completion length quantiles in tokens (p50 <= p90), and which part of the
    predictor produced them (for metrics and debugging)."""

    p50: float
    p90: float
    source: str = ""

    def clamp(self, max_tokens: int) -> LengthEstimate:
        hi = float(max(1, max_tokens))
        p50 = min(hi, max(1.0, self.p50))
        return LengthEstimate(p50, min(hi, max(p50, self.p90)), self.source)

    def tokens(self, max_tokens: int) -> int:
        """p50 as an integer in [1, max_tokens]."""
        return max(1, min(max(1, max_tokens), math.ceil(self.p50 - 1e-6)))


class OutputLengthPredictor(ABC):
    name: str = "base"

    @abstractmethod
    def estimate(self, query: LengthQuery) -> LengthEstimate:
        """Quantiles of the completion length, clamped to [1, max_tokens]."""

    def learn(self, query: LengthQuery, completion_tokens: int) -> None:
        """A request finished with this many completion tokens."""
        return None

    # -- the narrow interface the orchestrator used before queries existed
    def predict(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return self.estimate(LengthQuery(num_prompt_tokens, max_tokens)).tokens(max_tokens)

    def observe(self, num_prompt_tokens: int, completion_tokens: int) -> None:
        self.learn(LengthQuery(num_prompt_tokens, max(1, completion_tokens)), completion_tokens)


class EwmaPredictor(OutputLengthPredictor):
    """min(max_tokens, EWMA of recent completion lengths); `initial` until the
    first observation. Same number for every request: the baseline."""

    name = "ewma"

    def __init__(self, alpha: float = 0.2, initial: float = 64.0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.ewma = float(initial)

    def estimate(self, query: LengthQuery) -> LengthEstimate:
        return LengthEstimate(self.ewma, 2.0 * self.ewma, "ewma").clamp(query.max_tokens)

    def learn(self, query: LengthQuery, completion_tokens: int) -> None:
        if completion_tokens > 0:
            self.ewma += self.alpha * (completion_tokens - self.ewma)


class OraclePredictor(OutputLengthPredictor):
    """Benchmark-only: the true length when the request carries it, else `inner`."""

    name = "oracle"

    def __init__(self, inner: OutputLengthPredictor) -> None:
        self.inner = inner

    def estimate(self, query: LengthQuery) -> LengthEstimate:
        if query.oracle_tokens > 0:
            n = float(query.oracle_tokens)
            return LengthEstimate(n, n, "oracle").clamp(query.max_tokens)
        return self.inner.estimate(query)

    def learn(self, query: LengthQuery, completion_tokens: int) -> None:
        if query.oracle_tokens <= 0:  # the inner one learns from the others only
            self.inner.learn(query, completion_tokens)
