"""Output-length prediction: how many tokens a decode instance should reserve
beyond the prompt. Behind an interface so a smarter predictor can replace the
EWMA without touching the orchestrator."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod


class OutputLengthPredictor(ABC):
    @abstractmethod
    def predict(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Predicted completion tokens, in [1, max_tokens]."""

    @abstractmethod
    def observe(self, num_prompt_tokens: int, completion_tokens: int) -> None:
        """A request finished with this many completion tokens."""


class EwmaPredictor(OutputLengthPredictor):
    """min(max_tokens, EWMA of recent completion lengths); `initial` until the
    first observation."""

    def __init__(self, alpha: float = 0.2, initial: float = 64.0) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError("alpha must be in (0, 1]")
        self.alpha = alpha
        self.ewma = float(initial)

    def predict(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return max(1, min(max_tokens, math.ceil(self.ewma)))

    def observe(self, num_prompt_tokens: int, completion_tokens: int) -> None:
        if completion_tokens > 0:
            self.ewma += self.alpha * (completion_tokens - self.ewma)
