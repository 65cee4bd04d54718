"""Per-request state (torch-free). One Sequence per request, owned by the scheduler."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # monotonically increasing admission order
    output_token_ids: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    # tokens of all_token_ids whose K/V are in the cache (in block_table)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    # the sliding window group's table (KVCacheManager with a window; [] without one): same
    # length as block_table, its first num_window_freed entries freed (NULL_BLOCK)
    window_table: list[int] = field(default_factory=list)
    num_window_freed: int = 0
    # chained hashes of the full blocks of all_token_ids, computed lazily (prefix caching)
    block_hashes: list[bytes] = field(default_factory=list)
    # how many leading blocks of block_table are already registered in the prefix cache
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0  # prefix-cache hit on first scheduling
    num_preemptions: int = 0
    finish_reason: str | None = None
    prefill_only: bool = False
    kv_sink: Callable[[int, Any], None] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, stop: int) -> list[int]:
        """`all_token_ids[start:stop]` (0 <= start <= stop) without building the whole list."""
        prompt = self.prompt_token_ids
        n = len(prompt)
        if stop <= n:
            return prompt[start:stop]
        if start >= n:
            return self.output_token_ids[start - n : stop - n]
        return prompt[start:] + self.output_token_ids[: stop - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
