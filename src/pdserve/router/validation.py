"""Router-side request checks. Ranges for sampling and prompt tokens have one
source of truth: `pdserve.engine.params` (torch-free); the router adds what only
it sees (session id, stop strings, the prompt oneof, chat messages)."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pdserve.engine.params import SamplingParams, validate_request
from pdserve.errors import InvalidRequestError
from pdserve.v1 import common_pb2

SESSION_ID_RE = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
DEFAULT_MAX_TOKENS = 128
CHAT_ROLES = ("system", "user", "assistant")


def check_session_id(session_id: str) -> None:
    if session_id and not SESSION_ID_RE.fullmatch(session_id):
        raise InvalidRequestError(
            "session_id", "must match [A-Za-z0-9_.:-]{1,128} (1-128 letters, digits, _ . : -)"
        )


def check_stops(stops: Sequence[str]) -> None:
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequestError(
            "stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(stops)}"
        )
    for i, s in enumerate(stops):
        if not s:
            raise InvalidRequestError("stop", f"stop string {i} is empty")
        if len(s) > MAX_STOP_CHARS:
            raise InvalidRequestError(
                "stop", f"stop string {i} has {len(s)} characters; at most {MAX_STOP_CHARS}"
            )


def check_messages(messages: Sequence[tuple[str, str]]) -> None:
    if not messages:
        raise InvalidRequestError("chat", "needs at least one message")
    for i, (role, _content) in enumerate(messages):
        if role not in CHAT_ROLES:
            raise InvalidRequestError(
                "chat", f"message {i} has role {role!r}; allowed: {', '.join(CHAT_ROLES)}"
            )


def to_params(
    sp: common_pb2.SamplingParams, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    """Proto -> engine params; unset fields take the engine defaults. An unset
    max_tokens is clamped to the room left in the context."""
    if sp.output_offset:
        raise InvalidRequestError(
            "sampling.output_offset",
            "is set by the router when it moves a stream to another worker; leave it 0",
        )
    if sp.HasField("max_tokens"):
        max_tokens = sp.max_tokens
    else:
        max_tokens = max(1, min(DEFAULT_MAX_TOKENS, max_model_len - num_prompt_tokens))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=sp.temperature if sp.HasField("temperature") else 1.0,
        top_p=sp.top_p if sp.HasField("top_p") else 1.0,
        top_k=sp.top_k,
        seed=sp.seed if sp.HasField("seed") else None,
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
    )


def check_request(
    token_ids: Sequence[int],
    params: SamplingParams,
    stops: Sequence[str],
    session_id: str,
    vocab_size: int,
    max_model_len: int,
) -> None:
    """Raise InvalidRequestError naming the field and its allowed range."""
    check_session_id(session_id)
    check_stops(stops)
    validate_request(token_ids, params, vocab_size, max_model_len)
