"""Multi-turn chat sessions: keep the message history and a session id (the
router uses it for affinity and KV reuse across turns)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import closing
from typing import Any

from .aio import AsyncClient
from .results import GenerationEvent, GenerationResult, collect
from .sync import Client


class _History:
    def __init__(
        self, system: str | None, session_id: str | None, defaults: dict[str, Any]
    ) -> None:
        self.system = system
        self.session_id = session_id or uuid.uuid4().hex
        self.messages: list[dict[str, str]] = []
        if system:
            self.messages.append({"role": "system", "content": system})
        self.defaults = defaults

    def request(self, text: str, overrides: dict[str, Any]) -> dict[str, Any]:
        kwargs = {**self.defaults, **overrides}
        return {
            **kwargs,
            "messages": [*self.messages, {"role": "user", "content": text}],
            "session_id": self.session_id,
        }

    def commit(self, text: str, reply: str) -> None:
        """Only a completed turn enters the history."""
        self.messages.append({"role": "user", "content": text})
        self.messages.append({"role": "assistant", "content": reply})


class ChatSession:
    """`ChatSession(Client(addr), system="...")`; `send(text)` -> GenerationResult,
    `stream(text)` yields events. Default generation keywords via `**defaults`."""

    def __init__(
        self,
        client: Client,
        system: str | None = None,
        session_id: str | None = None,
        **defaults: Any,
    ) -> None:
        self.client = client
        self._h = _History(system, session_id, defaults)

    @property
    def session_id(self) -> str:
        return self._h.session_id

    @property
    def messages(self) -> list[dict[str, str]]:
        return self._h.messages

    def reset(self) -> None:
        """Forget the conversation (keeps the system prompt and defaults; new session id)."""
        self._h = _History(self._h.system, None, self._h.defaults)

    def stream(self, text: str, **overrides: Any) -> Iterator[GenerationEvent]:
        """The reply's events; the turn enters the history only when the reply completed.
        Closing it early (or Ctrl-C) cancels the call at once (see Client.generate_stream)."""
        parts: list[str] = []
        with closing(self.client.generate_stream(**self._h.request(text, overrides))) as events:
            for ev in events:
                parts.append(ev.text)
                yield ev
        self._h.commit(text, "".join(parts))

    def send(self, text: str, **overrides: Any) -> GenerationResult:
        start = time.perf_counter()
        result = collect(list(self.stream(text, **overrides)), start)
        return result


class AsyncChatSession:
    """The asyncio twin of ChatSession, on an AsyncClient."""

    def __init__(
        self,
        client: AsyncClient,
        system: str | None = None,
        session_id: str | None = None,
        **defaults: Any,
    ) -> None:
        self.client = client
        self._h = _History(system, session_id, defaults)

    @property
    def session_id(self) -> str:
        return self._h.session_id

    @property
    def messages(self) -> list[dict[str, str]]:
        return self._h.messages

    def reset(self) -> None:
        """Forget the conversation (keeps the system prompt and defaults; new session id)."""
        self._h = _History(self._h.system, None, self._h.defaults)

    async def stream(self, text: str, **overrides: Any) -> AsyncIterator[GenerationEvent]:
        parts: list[str] = []
        async for ev in self.client.generate_stream(**self._h.request(text, overrides)):
            parts.append(ev.text)
            yield ev
        self._h.commit(text, "".join(parts))

    async def send(self, text: str, **overrides: Any) -> GenerationResult:
        start = time.perf_counter()
        return collect([ev async for ev in self.stream(text, **overrides)], start)
