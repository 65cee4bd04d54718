"""Plain domain objects of the worker (no proto, no tensors)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Ticket:
    """Where a prefill pushes one request's KV: the decode's UCX worker, tags
    `tag_base + layer`, valid until `lease_expiry_unix_s`."""

    ticket_id: int
    decode_instance_id: str
    ucx_worker_address: bytes
    tag_base: int
    lease_expiry_unix_s: float
    num_blocks: int
    kv_fingerprint: str
    nonce: bytes = b""  # NONCE_BYTES random bytes, sent back with token 0 (see decode.py)


@dataclass
class StageCosts:
    """Per-request stage costs; the router sums the prefill's and the decode's."""

    queue_ms: float = 0.0  # decode: last KV layer landed -> admitted to the batch
    prefill_ms: float = 0.0  # prefill (or colocated): arrival -> token 0 (incl. queueing)
    transfer_ms: float = 0.0  # prefill: exposed transfer, token 0 computed -> every layer sent
    transfer_bytes: int = 0  # KV bytes pushed to the decode
    decode_ms: float = 0.0  # decode (or colocated): admission (token 0) -> last token
    cached_tokens: int = 0
    kvstore_tokens: int = 0


@dataclass
class TokenEvent:
    """One chunk of a token stream; the last one has `finish_reason` and `stages`."""

    token_ids: list[int]
    finish_reason: str | None = None
    stages: StageCosts | None = None
