"""Prompt features for the offline length model, numpy only and deterministic:
hashed word unigrams/bigrams and character 3-5-grams (signed feature hashing,
sublinear counts) plus a few structure features (length, lines, code, script,
keywords that ask for long or short answers). Long prompts are cut to their
first and last `max_chars` / 2 characters so featurizing stays a few ms."""

from __future__ import annotations

import itertools
import re
import zlib
from collections import Counter

import numpy as np

TOKEN = re.compile(r"\w+|[^\w\s]")
KEYWORDS = (
    "code", "write", "python", "function", "explain", "essay", "story", "list", "step",
    "detail", "short", "brief", "one word", "only", "yes or no", "translate", "summar",
    "poem", "table", "example", "implement", "script", "class", "sql", "compare",
    "what is", "how to", "?", "```", "please", "json", "letter", "email", "plan",
    "guide", "prove", "calculate", "solve", "rewrite", "improve", "fix", "error",
)  # fmt: skip
NUM_STRUCT = 5 + len(KEYWORDS)


def clip_text(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    half = max_chars // 2
    return text[:half] + " " + text[-half:]


def hashed_ngrams(text: str, dim: int, max_chars: int = 4000) -> tuple[np.ndarray, np.ndarray]:
    """Sorted unique indices in [0, dim) and their signed weights 1 + log(count)."""
    words = TOKEN.findall(clip_text(text, max_chars).lower())
    grams: Counter[str] = Counter()
    grams.update("w:" + w for w in words)
    grams.update("b:" + a + " " + b for a, b in itertools.pairwise(words))
    joined = " ".join(words)
    for n in (3, 4, 5):
        grams.update("c:" + joined[i : i + n] for i in range(len(joined) - n + 1))
    acc: dict[int, float] = {}
    for gram, count in grams.items():
        h = zlib.crc32(gram.encode("utf-8"))
        sign = 1.0 if h & 0x80000000 else -1.0
        j = h % dim
        acc[j] = acc.get(j, 0.0) + sign * (1.0 + float(np.log(count)))
    idx = np.fromiter(sorted(acc), dtype=np.int64, count=len(acc))
    val = np.fromiter((acc[int(j)] for j in idx), dtype=np.float64, count=len(acc))
    return idx, val


def structure(text: str, num_prompt_tokens: int) -> np.ndarray:
    low = text.lower()
    base = [
        float(np.log1p(len(text))),
        float(np.log1p(text.count("\n"))),
        float(np.log1p(max(0, num_prompt_tokens))),
        float(any(ord(c) > 127 for c in text[:2000])),
        float(np.log1p(sum(c.isdigit() for c in text[:2000]))),
    ]
    return np.asarray(base + [float(k in low) for k in KEYWORDS], dtype=np.float64)
