"""What the router knows about one request while it runs (`Job`), what the orchestrator yields
(`Chunk`), and the deadlines every worker call runs under. Plain data: no I/O."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.params import SamplingParams
from pdserve.v1 import common_pb2


@dataclass(frozen=True)
class Deadlines:
    reserve_s: float = 5.0
    kv_queue_s: float = 30.0  # wait this long for free decode KV blocks before giving up
    prefill_s: float = 120.0
    first_token_s: float = 120.0  # colocated Generate / Decode: wait for the first chunk
    decode_idle_s: float = 60.0  # longest gap between two chunks of a stream
    abort_s: float = 2.0


@dataclass
class Job:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sampling: common_pb2.SamplingParams  # forwarded to workers (max_tokens filled in)
    session_id: str = ""
    # Filled while it runs:
    stages: common_pb2.StageCosts = field(default_factory=common_pb2.StageCosts)
    prefill_instance: str = ""
    decode_instance: str = ""
    prefill_attempts: int = 0
    output_token_ids: list[int] = field(default_factory=list)  # every token yielded so far
    # What the length predictor may read (besides tokens, session and max_tokens):
    prompt_text: str | None = None  # the prompt as text (chat rendered), if it came as text
    model: str = ""
    oracle_tokens: int = 0  # benchmark oracle mode only: the true output length


@dataclass(frozen=True)
class Chunk:
    token_ids: list[int]
    finish_reason: int = common_pb2.FINISH_REASON_UNSPECIFIED


def add_stages(total: common_pb2.StageCosts, part: common_pb2.StageCosts) -> None:
    for f in common_pb2.StageCosts.DESCRIPTOR.fields:
        setattr(total, f.name, getattr(total, f.name) + getattr(part, f.name))
