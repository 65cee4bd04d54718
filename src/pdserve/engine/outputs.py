"""What the engine hands back after each step (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "prefill_done"
    num_cached_tokens: int = 0  # prefix-cache hit, in tokens
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # generated so far, including new_token_ids
    num_preemptions: int = 0
    extras: dict = field(default_factory=dict)
