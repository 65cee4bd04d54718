"""Token ids -> text deltas for one request: incremental detokenization (the U+FFFD
rule of docs/HTTP_API.md, "Text") followed by the stop-string matcher. With stop strings
it feeds one token at a time, so a stop string is attributed to the token completing it;
without, a chunk's tokens go to the detokenizer at once (two decodes per chunk, not per
token: the same text, since the detokenizer's deltas concatenate to decode(all tokens))."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from .stops import StopMatcher


class Detokenizer(Protocol):
    def add(self, token_ids: Sequence[int]) -> str:
        """New complete text for these new tokens (may be empty)."""
        ...

    def flush(self) -> str:
        """End of stream: whatever is still held back."""
        ...


@dataclass
class TextStep:
    token_ids: list[int]  # tokens to report (up to the one completing a stop string)
    text: str  # text delta safe to send
    stopped: bool  # a stop string matched: the request ends here


class TextStream:
    def __init__(self, detok: Detokenizer, stops: Sequence[str] = ()) -> None:
        self.detok = detok
        self.matcher = StopMatcher(stops)
        self.text = ""  # everything sent so far

    def push(self, token_ids: Sequence[int]) -> TextStep:
        if not self.matcher.stops:
            text = self.detok.add(token_ids) if token_ids else ""
            self.text += text
            return TextStep(list(token_ids), text, False)
        out_ids: list[int] = []
        out_text: list[str] = []
        for tid in token_ids:
            out_ids.append(tid)
            emit, stopped = self.matcher.feed(self.detok.add([tid]))
            out_text.append(emit)
            if stopped:
                return self._step(out_ids, out_text, True)
        return self._step(out_ids, out_text, False)

    def finish(self) -> str:
        """The stream ended without a stop string: release held-back text. A stop
        string may still complete inside the detokenizer's tail."""
        emit, stopped = self.matcher.feed(self.detok.flush())
        if not stopped:
            emit += self.matcher.flush()
        self.text += emit
        return emit

    def _step(self, ids: list[int], parts: list[str], stopped: bool) -> TextStep:
        text = "".join(parts)
        self.text += text
        return TextStep(ids, text, stopped)
