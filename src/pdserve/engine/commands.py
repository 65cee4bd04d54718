"""The engine commands: what asyncio code may ask of the engine thread (torch-free types).

Each is a frozen dataclass executed by `AsyncEngine._execute`, the one dispatch place. A command
that takes blocks registers them under its request id before its result crosses back, so
`Release(request_id)` / `Abort(request_id)` can always free them, whatever happened to the
caller (cancelled, timed out).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.engine.params import SamplingParams


@dataclass(frozen=True)
class AddRequest:
    """Start a request and stream its outputs (prefill and decode here, or prefill only)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    params: SamplingParams
    prefill_only: bool = False
    kv_sink: Callable[[int, Any], None] | None = None  # (layer, kv) on the engine thread
    hold_on_finish: bool = False  # keep its finished blocks until Release (kvstore publish)


@dataclass(frozen=True)
class AdmitPrefilled:
    """Decode side: write the received KV into the request's reserved blocks and admit it
    with token 0 sampled elsewhere; stream tokens 1.. On failure its reservation is freed."""

    request_id: str
    prompt_token_ids: Sequence[int]
    first_token: int
    params: SamplingParams
    kv: Any  # per stored layer [n_blocks, 2, bs, kvh_l, hd_l]
    hold_on_finish: bool = False


@dataclass(frozen=True)
class Reserve:
    """Reserve blocks for `num_tokens` tokens of a request whose KV (of its first
    `num_kv_tokens` tokens) arrives from elsewhere (a window group reserves its window)."""

    request_id: str
    num_tokens: int
    num_kv_tokens: int = 0


@dataclass(frozen=True)
class Release:
    """Free a request's reservation and holds (idempotent). Result: blocks released."""

    request_id: str


@dataclass(frozen=True)
class Abort:
    """Stop a request and free all it owns (idempotent). Result: whether it was live."""

    request_id: str


@dataclass(frozen=True)
class HoldOnFinish:
    """Keep `request_id`'s computed blocks when it finishes, until Release."""

    request_id: str


@dataclass(frozen=True)
class CachedPrefixLength:
    """How many leading blocks of the chain `hashes` are cached locally."""

    hashes: Sequence[bytes]


@dataclass(frozen=True)
class ImportAndHold:
    """Insert fetched blocks (`data` for the chain `fetched`) into the prefix cache and hold
    the whole locally cached prefix of `hashes` for `request_id` until it is scheduled, in
    one command: nothing can evict the prefix between the import and the hold."""

    request_id: str
    hashes: Sequence[bytes]
    fetched: Sequence[bytes]
    data: Any  # [len(fetched), L, 2, bs, kvh, hd]
    hold_on_finish: bool = False
    window_from: int = 0  # blocks of `fetched` before it carry no sliding-layer KV


@dataclass(frozen=True)
class ReadForPublish:
    """Copy the locally cached blocks of the chain `hashes` past the first `skip` ones.
    Result: a tensor [n, L, ...] or None."""

    hashes: Sequence[bytes]
    skip: int


@dataclass(frozen=True)
class Inspect:
    """Exact block accounting, checked (check_integrity raises on drift)."""


@dataclass(frozen=True)
class EngineInspection:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_reservations: int
    num_reserved_blocks: int
    num_held_blocks: int
    num_streams: int


Command = (
    AddRequest
    | AdmitPrefilled
    | Reserve
    | Release
    | Abort
    | HoldOnFinish
    | CachedPrefixLength
    | ImportAndHold
    | ReadForPublish
    | Inspect
)
