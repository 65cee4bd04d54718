"""Result files and printed tables.

A run's JSON: {"config": ..., "records": [RequestRecord.to_json()], "summary": summarize(),
"goodput": ..., "sweep": [...]}. A comparison's JSON holds one such result per arm plus the
ratio table.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.workload.metrics import RequestRecord


def write_json(path: str | Path, data: Any) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))
    return path


def latency_arrays(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Per-request latencies in ms for the CDF plots."""
    done = [r for r in records if r.ok]
    return {
        "ttft": [r.ttft_s * 1e3 for r in done if r.ttft_s is not None],
        "tpot": [r.tpot_s * 1e3 for r in done if r.tpot_s is not None],
        "e2e": [r.e2e_s * 1e3 for r in done if r.e2e_s is not None],
    }


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.1f}"
    return str(v)


def format_summary(summary: Mapping[str, Any], goodput: Mapping[str, Any] | None = None) -> str:
    lines = [
        f"requests      {summary['completed']}/{summary['num_requests']} ok "
        f"({summary['failed']} failed) in {summary['duration_s']:.2f} s",
        f"throughput    {summary['request_throughput']:.3f} req/s, "
        f"in {summary['input_token_throughput']:.1f} tok/s, "
        f"out {summary['output_token_throughput']:.1f} tok/s",
        f"cache hits    {summary['cache_hit_rate']:.1%} of prompt tokens",
        f"{'metric':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}   (ms)",
    ]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        s = summary[key]
        lines.append(
            f"{key[:-3].upper():<10}"
            + "".join(f"{_fmt(s.get(p)):>10}" for p in ("mean", "p50", "p90", "p99"))
        )
    st = summary["stages"]["per_request"]
    lines.append(
        "stages/req    "
        f"queue {st['queue_ms']:.1f} ms, prefill {st['prefill_ms']:.1f} ms, "
        f"transfer {st['transfer_ms']:.1f} ms ({st['transfer_bytes'] / 2**20:.2f} MiB), "
        f"decode {st['decode_ms']:.1f} ms"
    )
    if goodput:
        for k, v in goodput.items():
            lines.append(f"goodput       {k}: {_fmt(v)}")
    return "\n".join(lines)


# (label, path into an arm's result) for the comparison table
RATIO_ROWS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("goodput vLLM (req/s)", ("goodput", "vllm_req_s")),
    ("goodput DistServe (req/s)", ("goodput", "distserve", "interpolated")),
    ("request throughput", ("summary", "request_throughput")),
    ("output tok/s", ("summary", "output_token_throughput")),
    ("TTFT p50 (ms)", ("summary", "ttft_ms", "p50")),
    ("TTFT p99 (ms)", ("summary", "ttft_ms", "p99")),
    ("TPOT p50 (ms)", ("summary", "tpot_ms", "p50")),
    ("TPOT p99 (ms)", ("summary", "tpot_ms", "p99")),
    ("E2E p50 (ms)", ("summary", "e2e_ms", "p50")),
    ("E2E p99 (ms)", ("summary", "e2e_ms", "p99")),
    ("prefill s/req", ("summary", "stages", "per_request", "prefill_ms")),
    ("decode s/req", ("summary", "stages", "per_request", "decode_ms")),
    ("transfer ms/req", ("summary", "stages", "per_request", "transfer_ms")),
    ("cache hit rate", ("summary", "cache_hit_rate")),
)


def _dig(d: Any, path: Sequence[str]) -> Any:
    for k in path:
        if not isinstance(d, Mapping) or k not in d:
            return None
        d = d[k]
    return d


def ratio_table(
    results: Mapping[str, Mapping[str, Any]], numerator: str, denominator: str
) -> list[dict[str, Any]]:
    """Rows {metric, <numerator>, <denominator>, ratio}; ratio = numerator / denominator."""
    rows = []
    for label, path in RATIO_ROWS:
        a, b = _dig(results[numerator], path), _dig(results[denominator], path)
        if label.startswith(("prefill s", "decode s")):  # stored in ms
            a = a / 1e3 if isinstance(a, int | float) else a
            b = b / 1e3 if isinstance(b, int | float) else b
        ratio = a / b if isinstance(a, int | float) and isinstance(b, int | float) and b else None
        rows.append({"metric": label, numerator: a, denominator: b, "ratio": ratio})
    return rows


def format_ratio_table(rows: Sequence[Mapping[str, Any]], numerator: str, denominator: str) -> str:
    head = f"{'metric':<28}{numerator:>14}{denominator:>14}{'ratio':>10}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['metric']:<28}{_fmt(r[numerator]):>14}{_fmt(r[denominator]):>14}"
            f"{_fmt(r['ratio']):>10}"
        )
    return "\n".join(lines)
