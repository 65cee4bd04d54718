"""Bounded input on the public API: sizes are checked on the raw request, before any
tokenization or allocation, and refused with INVALID_ARGUMENT naming the limit.

(The gRPC message size itself is bounded by the public server's max receive length,
RouterSettings.max_request_bytes; a larger message is RESOURCE_EXHAUSTED from grpc.)
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.errors import InvalidRequestError
from pdserve.v1 import router_pb2

from .validation import MAX_STOP_CHARS, MAX_STOP_STRINGS, check_session_id, check_stops

CHARS_PER_TOKEN_BOUND = 32  # default prompt-chars limit = this x the context length
FALLBACK_MAX_PROMPT_CHARS = 1_000_000  # when the context length is unknown


@dataclass(frozen=True)
class InputLimits:
    max_prompt_chars: int
    max_chat_messages: int
    max_prompt_tokens: int
    max_model_len: int = 0
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_chars: int = MAX_STOP_CHARS

    @classmethod
    def from_settings(cls, settings, max_model_len: int) -> InputLimits:
        known = 0 < max_model_len < (1 << 30)
        chars = settings.max_prompt_chars or (
            CHARS_PER_TOKEN_BOUND * max_model_len if known else FALLBACK_MAX_PROMPT_CHARS
        )
        tokens = settings.max_prompt_tokens or (max_model_len if known else 1 << 20)
        return cls(
            chars,
            settings.max_chat_messages,
            tokens,
            max_model_len,
            settings.max_stop_strings,
            settings.max_stop_chars,
        )

    def too_many_tokens(self, n: int) -> str:
        return (
            f"{n} tokens; at most max_prompt_tokens={self.max_prompt_tokens} "
            f"(the context length max_model_len is {self.max_model_len})"
        )


def check_raw_request(req: router_pb2.GenerateRequest, limits: InputLimits) -> None:
    """Everything that can be refused from the request's sizes alone."""
    check_session_id(req.session_id)
    check_stops(req.sampling.stop, limits.max_stop_strings, limits.max_stop_chars)
    kind = req.WhichOneof("prompt")
    if kind == "text":
        if len(req.text) > limits.max_prompt_chars:
            raise InvalidRequestError(
                "prompt",
                f"text has {len(req.text)} characters; at most {limits.max_prompt_chars}",
            )
    elif kind == "chat":
        n = len(req.chat.messages)
        if n > limits.max_chat_messages:
            raise InvalidRequestError("chat", f"{n} messages; at most {limits.max_chat_messages}")
        total = sum(len(m.content) + len(m.role) for m in req.chat.messages)
        if total > limits.max_prompt_chars:
            raise InvalidRequestError(
                "chat", f"messages have {total} characters; at most {limits.max_prompt_chars}"
            )
    elif kind == "token_ids":
        n = len(req.token_ids.ids)
        if n > limits.max_prompt_tokens:
            raise InvalidRequestError("prompt", limits.too_many_tokens(n))
