"""Stop strings over a stream of text deltas.

`StopMatcher.feed(delta)` returns the text that is safe to emit now and whether
a stop string matched. Text that could be the start of a stop string is held
back; on a match the output is truncated before the stop string. Invariant:
emitted text + held-back text == all text fed (until a match).
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._held = ""
        self.matched: str | None = None

    @property
    def held(self) -> str:
        return self._held

    def feed(self, delta: str) -> tuple[str, bool]:
        if self.matched is not None:
            return "", True
        if not self.stops:
            return delta, False
        text = self._held + delta
        # Earliest complete match wins (ties: the longer stop string).
        best: tuple[int, int] | None = None
        for s in self.stops:
            i = text.find(s)
            if i >= 0 and (best is None or (i, -len(s)) < (best[0], -best[1])):
                best = (i, len(s))
                self.matched = s
        if best is not None:
            self._held = ""
            return text[: best[0]], True
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """End of stream without a match: release the held-back text."""
        out, self._held = self._held, ""
        return out

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop."""
        longest = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
