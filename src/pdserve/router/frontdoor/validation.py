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
ENGINE_PROMPT_FIELD = "prompt_token_ids"  # what pdserve.engine.params calls the prompt ids
PROMPT_IDS_FIELD = "token_ids.ids"  # GenerateRequest's field for them


def check_session_id(session_id: str) -> None:
    if session_id and not SESSION_ID_RE.fullmatch(session_id):
        raise InvalidRequestError(
            "session_id", "must match [A-Za-z0-9_.:-]{1,128} (1-128 letters, digits, _ . : -)"
        )


def check_stops(
    stops: Sequence[str], max_strings: int = MAX_STOP_STRINGS, max_chars: int = MAX_STOP_CHARS
) -> None:
    if len(stops) > max_strings:
        raise InvalidRequestError("stop", f"at most {max_strings} stop strings, got {len(stops)}")
    for i, s in enumerate(stops):
        if not s:
            raise InvalidRequestError("stop", f"stop string {i} is empty")
        if len(s) > max_chars:
            raise InvalidRequestError(
                "stop", f"stop string {i} has {len(s)} characters; at most {max_chars}"
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
    max_stop_strings: int = MAX_STOP_STRINGS,
    max_stop_chars: int = MAX_STOP_CHARS,
) -> None:
    """Raise InvalidRequestError naming the field and its allowed range."""
    check_session_id(session_id)
    check_stops(stops, max_stop_strings, max_stop_chars)
    try:
        validate_request(token_ids, params, vocab_size, max_model_len)
    except InvalidRequestError as exc:
        if exc.field != ENGINE_PROMPT_FIELD:
            raise
        # The engine names its argument; clients know the proto field.
        message = str(exc).removeprefix(f"{ENGINE_PROMPT_FIELD}: ")
        raise InvalidRequestError(PROMPT_IDS_FIELD, message) from None
