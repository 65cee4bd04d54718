"""SamplingParams and request validation at the engine boundary (torch-free)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # (0, 1]; 1 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # position-derived: token i uses a generator seeded by (seed, i)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Output tokens generated before this request (router migration: they are now part of the
    # prompt); seeded sampling draws output token i with index output_offset + i.
    output_offset: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def validate_params(params: SamplingParams) -> None:
    if not isinstance(params.max_tokens, int) or params.max_tokens < 1:
        raise InvalidRequestError("max_tokens", f"must be an integer >= 1, got {params.max_tokens}")
    t = params.temperature
    if not math.isfinite(t) or t < 0:
        raise InvalidRequestError("temperature", f"must be a finite number >= 0, got {t}")
    p = params.top_p
    if not math.isfinite(p) or not 0.0 < p <= 1.0:
        raise InvalidRequestError("top_p", f"must be in (0, 1], got {p}")
    if not isinstance(params.top_k, int) or params.top_k < 0:
        raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 = off), got {params.top_k}")
    if not isinstance(params.output_offset, int) or params.output_offset < 0:
        raise InvalidRequestError(
            "output_offset", f"must be an integer >= 0, got {params.output_offset!r}"
        )
    if params.seed is not None and not isinstance(params.seed, int):
        raise InvalidRequestError("seed", f"must be an integer or unset, got {params.seed!r}")


def validate_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raise InvalidRequestError(field, message) naming the field and its allowed range."""
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt", "must contain at least 1 token")
    for i, t in enumerate(prompt_token_ids):
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                "prompt_token_ids",
                f"token at index {i} is {t!r}; ids must be integers in [0, {vocab_size})",
            )
    validate_params(params)
    for t in params.stop_token_ids:
        if not isinstance(t, int) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                "stop_token_ids", f"{t!r} is not a token id; ids must be in [0, {vocab_size})"
            )
    if n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            "max_tokens",
            f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
            f"{n + params.max_tokens} exceeds the context length max_model_len={max_model_len}",
        )
