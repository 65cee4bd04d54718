"""OpenAI request bodies -> `router_pb2.GenerateRequest` (the message a gRPC client sends, so
HTTP and gRPC requests are the same object and pass the same checks), and GenerateResponse
streams -> OpenAI JSON. The server builds the message itself: it never imports the client SDK.

Supported: n=1; temperature, top_p, max_tokens / max_completion_tokens, stop, seed; vLLM's
extra fields top_k, ignore_eos, stop_token_ids, return_token_ids; pdserve's session_id.
Refused with 400 naming the parameter: n > 1, logprobs / top_logprobs, echo, suffix,
best_of > 1, non-zero presence/frequency penalties, tools, non-text message parts.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve.errors import InvalidRequestError
from pdserve.v1 import common_pb2, router_pb2

FINISH = {
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
}


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    top_logprobs: int | None = None
    user: str | None = None
    # vLLM extras
    top_k: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)
    return_token_ids: bool = False
    # pdserve extra: prefix affinity / KV reuse across a conversation
    session_id: str | None = None

    def refuse_unsupported(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("n", f"only n=1 is supported, got {self.n}")
        if self.logprobs not in (None, False, 0) or self.top_logprobs:
            raise InvalidRequestError("logprobs", "logprobs are not supported yet")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise InvalidRequestError(name, "penalties are not supported; send 0 or omit")
        if self.top_k < 0 and self.top_k != -1:
            raise InvalidRequestError("top_k", f"must be >= 0 (0 or -1 = off), got {self.top_k}")

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))

    def _request(self, max_tokens: int | None) -> router_pb2.GenerateRequest:
        """The GenerateRequest without its prompt; unset fields keep the proto defaults
        (the front door's validation fills them in, as for a gRPC request)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        sampling = common_pb2.SamplingParams(
            top_k=max(0, self.top_k),
            ignore_eos=self.ignore_eos,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
        )
        if max_tokens is not None:
            sampling.max_tokens = max_tokens
        if self.temperature is not None:
            sampling.temperature = self.temperature
        if self.top_p is not None:
            sampling.top_p = self.top_p
        if self.seed is not None:
            sampling.seed = self.seed
        return router_pb2.GenerateRequest(sampling=sampling, session_id=self.session_id or "")


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Common):
    messages: list[_Message]
    max_completion_tokens: int | None = Field(None, ge=1)
    tools: list[Any] | None = None

    def to_request(self) -> router_pb2.GenerateRequest:
        self.refuse_unsupported()
        if self.tools:
            raise InvalidRequestError("tools", "tool calls are not supported")
        messages = []
        for i, m in enumerate(self.messages):
            messages.append({"role": m.role, "content": _text_content(m.content, i)})
        if not messages:
            raise InvalidRequestError("messages", "needs at least one message")
        req = self._request(self.max_completion_tokens or self.max_tokens)
        req.chat.messages.extend(router_pb2.ChatMessage(**m) for m in messages)
        return req


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def to_request(self) -> router_pb2.GenerateRequest:
        self.refuse_unsupported()
        if self.echo:
            raise InvalidRequestError("echo", "echo is not supported")
        if self.suffix:
            raise InvalidRequestError("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise InvalidRequestError("best_of", "only best_of=1 is supported")
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise InvalidRequestError("prompt", "only one prompt per request (n=1)")
            prompt = prompt[0]
        req = self._request(self.max_tokens)
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt", "must not be empty")
            req.text = prompt
        else:
            req.token_ids.ids.extend(prompt)
        return req


def _text_content(content: str | list[dict[str, Any]] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise InvalidRequestError(
                "messages", f"message {i}: only text content parts are supported"
            )
        parts.append(part["text"])
    return "".join(parts)


def parse(model: type[_Common], body: Any) -> _Common:
    """Validate a JSON body; a type error becomes InvalidRequestError naming the parameter."""
    if not isinstance(body, dict):
        raise InvalidRequestError("body", "must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "body"
        raise InvalidRequestError(where.split(".")[0], f"{where}: {err.get('msg')}") from None


# ------------------------------------------------------------------ responses
def usage_json(usage: router_pb2.Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


class Shaper:
    """Builds the OpenAI objects of one request (chat or text completion)."""

    def __init__(self, kind: Literal["chat", "text"], model: str, rid: str, ids: bool) -> None:
        self.kind, self.model, self.ids = kind, model, ids
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + rid
        self.created = int(time.time())

    def _base(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def whole(
        self, text: str, token_ids: list[int], finish: int, usage: router_pb2.Usage
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": FINISH.get(finish), "logprobs": None}
        if self.kind == "chat":
            choice["message"] = {"role": "assistant", "content": text}
            out = self._base("chat.completion")
        else:
            choice["text"] = text
            out = self._base("text_completion")
        if self.ids:
            choice["token_ids"] = token_ids
        out["choices"] = [choice]
        out["usage"] = usage_json(usage)
        return out

    def chunk(
        self, text: str | None, token_ids: list[int], finish: int, first: bool = False
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": FINISH.get(finish) if finish else None,
            "logprobs": None,
        }
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if first else {}
            if text is not None:
                delta["content"] = text
            choice["delta"] = delta
            out = self._base("chat.completion.chunk")
        else:
            choice["text"] = text or ""
            out = self._base("text_completion")
        if self.ids:
            choice["token_ids"] = token_ids
        out["choices"] = [choice]
        return out

    def usage_chunk(self, usage: router_pb2.Usage) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        out = self._base(obj)
        out["choices"] = []
        out["usage"] = usage_json(usage)
        return out
