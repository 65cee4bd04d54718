"""Trace parsers: the Azure LLM inference CSV and the Mooncake JSONL formats.

Both yield `TraceRecord`s with the timestamp in seconds relative to the first record.
A malformed line raises `TraceFormatError` naming the file and the 1-based line number.
The files are read from wherever the user keeps them; nothing is copied.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
MOONCAKE_BLOCK_TOKENS = 512  # tokens covered by one Mooncake hash id


class TraceFormatError(ValueError):
    """A trace line that cannot be parsed; `path` and `line` locate it."""

    def __init__(self, path: str | Path, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line


@dataclass(frozen=True)
class TraceRecord:
    timestamp_s: float  # relative to the first record of the trace
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = field(default=())  # Mooncake only: one id per 512-token block


def _parse_len(value: object, name: str, path: Path, line: int) -> int:
    if isinstance(value, bool):
        raise TraceFormatError(path, line, f"{name} must be an integer, got {value!r}")
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise TraceFormatError(path, line, f"{name} is not a number: {value!r}") from None
    if number != number or number != int(number):
        raise TraceFormatError(path, line, f"{name} must be an integer, got {value!r}")
    if number < 0:
        raise TraceFormatError(path, line, f"{name} is negative: {value!r}")
    return int(number)


def _parse_azure_time(text: str, path: Path, line: int) -> float:
    text = text.strip()
    try:
        return float(text)  # already seconds
    except ValueError:
        pass
    # "2023-11-16 18:15:46.6805900": 7 fractional digits; datetime accepts at most 6.
    base, _, frac = text.partition(".")
    try:
        stamp = datetime.strptime(base, "%Y-%m-%d %H:%M:%S")
        frac_s = float("0." + frac) if frac else 0.0
    except ValueError:
        raise TraceFormatError(path, line, f"TIMESTAMP is not a date: {text!r}") from None
    return stamp.timestamp() + frac_s


def read_azure_csv(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Azure LLM inference trace: header TIMESTAMP,ContextTokens,GeneratedTokens."""
    path = Path(path)
    records: list[TraceRecord] = []
    t0: float | None = None
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            raise TraceFormatError(path, 1, "empty file (expected a header)")
        header = [h.strip() for h in header]
        missing = [c for c in AZURE_COLUMNS if c not in header]
        if missing:
            raise TraceFormatError(path, 1, f"header lacks column(s) {', '.join(missing)}")
        idx = [header.index(c) for c in AZURE_COLUMNS]
        for row in reader:
            line = reader.line_num
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) < len(header):
                raise TraceFormatError(
                    path, line, f"expected {len(header)} columns, got {len(row)}"
                )
            ts = _parse_azure_time(row[idx[0]], path, line)
            n_in = _parse_len(row[idx[1]].strip(), "ContextTokens", path, line)
            n_out = _parse_len(row[idx[2]].strip(), "GeneratedTokens", path, line)
            t0 = ts if t0 is None else t0
            records.append(TraceRecord(ts - t0, n_in, n_out))
            if limit is not None and len(records) >= limit:
                break
    return records


def read_mooncake_jsonl(path: str | Path, limit: int | None = None) -> list[TraceRecord]:
    """Mooncake trace: one JSON object per line with timestamp (ms), input_length,
    output_length, hash_ids (one id per 512-token block of the prompt)."""
    path = Path(path)
    records: list[TraceRecord] = []
    t0: float | None = None
    with path.open() as fh:
        for line_no, text in enumerate(fh, start=1):
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(path, line_no, f"bad JSON: {exc.msg}") from None
            if not isinstance(obj, dict):
                raise TraceFormatError(path, line_no, "expected a JSON object")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in obj:
                    raise TraceFormatError(path, line_no, f"missing field {key!r}")
            ts_ms = obj["timestamp"]
            if isinstance(ts_ms, bool) or not isinstance(ts_ms, int | float):
                raise TraceFormatError(path, line_no, f"timestamp is not a number: {ts_ms!r}")
            n_in = _parse_len(obj["input_length"], "input_length", path, line_no)
            n_out = _parse_len(obj["output_length"], "output_length", path, line_no)
            raw_ids = obj.get("hash_ids", [])
            if not isinstance(raw_ids, list):
                raise TraceFormatError(path, line_no, "hash_ids must be a list")
            ids = tuple(_parse_len(h, "hash_ids[]", path, line_no) for h in raw_ids)
            ts = float(ts_ms) / 1000.0
            t0 = ts if t0 is None else t0
            records.append(TraceRecord(ts - t0, n_in, n_out, ids))
            if limit is not None and len(records) >= limit:
                break
    return records


def read_trace(path: str | Path, fmt: str = "auto", limit: int | None = None) -> list[TraceRecord]:
    """Dispatch on `fmt` ("azure" | "mooncake" | "auto": by extension)."""
    path = Path(path)
    if fmt == "auto":
        fmt = "mooncake" if path.suffix in (".jsonl", ".json") else "azure"
    if fmt == "azure":
        return read_azure_csv(path, limit)
    if fmt == "mooncake":
        return read_mooncake_jsonl(path, limit)
    raise ValueError(f"unknown trace format {fmt!r} (azure | mooncake | auto)")
