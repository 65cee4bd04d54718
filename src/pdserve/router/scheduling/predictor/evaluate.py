"""Reading length data and scoring a predictor on it (offline or replayed online).

Two row formats: the length data (`prompt`, `model_canonical` or `model`,
`response_tokens_cl100k`, optional `prompt_split`, `prompt_tokens_cl100k`) and
Mooncake traces (`timestamp`, `input_length`, `output_length`, `hash_ids`)."""

from __future__ import annotations

import gzip
import json
import math
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from .base import LengthQuery, OutputLengthPredictor
from .offline import TextLengthModel
from .online import OnlineLengthPredictor
from .stats import summarize

UNBOUNDED = 1 << 30


def read_rows(path: str | Path) -> Iterator[dict[str, Any]]:
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{p}:{n}: not JSON: {exc}") from None
            yield row


def is_trace(row: Mapping[str, Any]) -> bool:
    return "output_length" in row and "hash_ids" in row


def actual_length(row: Mapping[str, Any]) -> int:
    for key in ("response_tokens_cl100k", "output_length", "completion_tokens"):
        if key in row:
            return int(row[key])
    raise ValueError(f"row has no length field: {sorted(row)}")


def model_of(row: Mapping[str, Any]) -> str:
    return str(row.get("model_canonical") or row.get("model") or "")


def query_of(row: Mapping[str, Any]) -> LengthQuery:
    if is_trace(row):
        return LengthQuery(
            num_prompt_tokens=int(row.get("input_length", 0)),
            max_tokens=UNBOUNDED,
            model=model_of(row),
            block_hashes=tuple(row["hash_ids"]),
            session_id=str(row.get("session_id", "")),
        )
    text = str(row.get("prompt", ""))
    return LengthQuery(
        num_prompt_tokens=int(row.get("prompt_tokens_cl100k") or max(1, len(text) // 4)),
        max_tokens=UNBOUNDED,
        model=model_of(row),
        text=text,
        session_id=str(row.get("session_id", "")),
    )


def evaluate_offline(model: TextLengthModel, rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Each row predicted from its text and model alone (scores cached per prompt)."""
    cache: dict[tuple[str, int], float] = {}
    p50, p90, actual, groups = [], [], [], []
    for row in rows:
        q = query_of(row)
        key = (q.text or "", q.num_prompt_tokens)
        if key not in cache:
            cache[key] = model.score(key[0], key[1])
        l50, l90 = model.log_quantiles(cache[key], q.model)
        p50.append(math.expm1(l50))
        p90.append(math.expm1(max(l50, l90)))
        actual.append(actual_length(row))
        groups.append(q.model)
    out = summarize(p50, p90, actual, groups)
    out["mode"] = "offline"
    return out


def evaluate_online(
    predictor: OutputLengthPredictor, rows: Sequence[Mapping[str, Any]]
) -> dict[str, Any]:
    """Replay in the given (arrival) order: predict, then learn the true length."""
    p50, p90, actual, groups = [], [], [], []
    for row in rows:
        q = query_of(row)
        est = predictor.estimate(q)
        n = actual_length(row)
        p50.append(est.p50)
        p90.append(est.p90)
        actual.append(n)
        groups.append(q.model)
        predictor.learn(q, n)
    out = summarize(p50, p90, actual, groups)
    out["mode"] = "online"
    return out


def default_online(text_model: TextLengthModel | None) -> OnlineLengthPredictor:
    return OnlineLengthPredictor(text_model)
