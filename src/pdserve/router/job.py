"""What the router knows about one request while it runs (`Job`), what the orchestrator yields
(`Chunk`), what its stages cost (`Stages`), and the deadlines every worker call runs under.
Plain domain data: no I/O, no protos held (the worker clients and the servicers convert;
`Chunk.finish_reason` keeps the wire's FinishReason numbers)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from pdserve.engine.params import SamplingParams
from pdserve.v1 import common_pb2


@dataclass(frozen=True)
class Deadlines:
    reserve_s: float = 60.0  # the ticket, from a decode that heartbeats (a lost one: at once)
    kv_queue_s: float = 30.0  # wait this long for free decode KV blocks before giving up
    prefill_s: float = 120.0
    first_token_s: float = 120.0  # colocated Generate / Decode: wait for the first chunk
    decode_idle_s: float = 60.0  # longest gap between two chunks of a stream
    abort_s: float = 2.0


@dataclass(frozen=True)
class DecodeTicket:
    """What a decode's Decode stream sent first (Ticket on the wire): where and how the prefill pushes
    the KV. The router only holds it and hands it on; the worker checks it."""

    ticket_id: int
    decode_instance_id: str
    ucx_worker_address: bytes
    tag_base: int
    lease_expiry_unix_s: float
    num_blocks: int
    kv_fingerprint: str
    nonce: bytes


@dataclass
class Stages:
    """Where a request's time went (StageCosts on the wire), summed over its attempts."""

    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    transfer_bytes: int = 0
    decode_ms: float = 0.0
    cached_tokens: int = 0  # prompt tokens reused (pool prefix cache or kvstore)
    kvstore_tokens: int = 0  # of which fetched from the kvstore
    reserve_ms: float = 0.0  # Decode opened -> its ticket read (the decode's Reserve)

    # Costs that describe the client's prompt, not work: a migrated stream's continuation
    # re-reads the prompt from a cache, which is not a cache hit of the client's.
    PROMPT_ONLY = ("cached_tokens", "kvstore_tokens")

    def add(self, part: Stages, *, skip: tuple[str, ...] = ()) -> None:
        for name in _STAGE_NAMES:
            if name not in skip:
                setattr(self, name, getattr(self, name) + getattr(part, name))


_STAGE_NAMES = tuple(f.name for f in fields(Stages))


@dataclass
class Job:
    request_id: str
    token_ids: list[int]
    params: SamplingParams  # validated; the worker clients send it (workers never see stops)
    session_id: str = ""
    # Filled while it runs:
    stages: Stages = field(default_factory=Stages)
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
