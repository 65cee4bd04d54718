"""Open-loop load generator on the async SDK.

Each request is sent at its scheduled arrival regardless of how many are still in flight
(open loop: the offered rate does not bend to the server). Streams are consumed on the event
loop; nothing here blocks it. Any client object with the SDK's `generate_stream` works, which
lets tests drive the generator with a fake.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, Protocol

from pdserve.workload.metrics import STAGE_FIELDS, RequestRecord
from pdserve.workload.requests import BenchRequest


class StreamingClient(Protocol):
    def generate_stream(self, **kwargs: Any) -> Any: ...  # async iterator of events


def _field(obj: Any, name: str, default: Any = None) -> Any:
    if obj is None:
        return default
    if isinstance(obj, dict):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _finish_name(reason: Any) -> str:
    if reason is None:
        return ""
    if isinstance(reason, int) and not isinstance(reason, bool):
        try:
            from pdserve.v1 import common_pb2

            return common_pb2.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()
        except (ImportError, ValueError):
            return str(reason)
    return str(getattr(reason, "name", reason)).lower()


def apply_usage(record: RequestRecord, usage: Any) -> None:
    """Copy `usage` (proto, dataclass or dict from the SDK) into the record."""
    if usage is None:
        return
    stages = _field(usage, "stages")
    record.stages = {k: float(_field(stages, k, 0.0) or 0.0) for k in STAGE_FIELDS}
    cached = _field(usage, "cached_tokens")
    if cached is None:
        cached = record.stages.get("cached_tokens", 0.0)
    record.cached_tokens = int(cached or 0)


async def send_one(
    client: StreamingClient,
    req: BenchRequest,
    t0: float,
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    arrival_s: float | None = None,
    collect: list[int] | None = None,
) -> RequestRecord:
    """Send one request now and stream it to completion; times are offsets from `t0`
    (a time.perf_counter() value). Output token ids are appended to `collect` if given.
    Errors are recorded, never raised."""
    now = time.perf_counter()
    rec = RequestRecord(
        index=req.index,
        arrival_s=req.arrival_s if arrival_s is None else arrival_s,
        send_s=now - t0,
        n_in=len(req.prompt_ids),
        max_tokens=req.max_tokens,
        session_id=req.session_id,
    )
    kwargs: dict[str, Any] = dict(
        max_tokens=req.max_tokens,
        temperature=temperature,
        ignore_eos=True,
    )
    if req.prompt_text is not None:
        kwargs["prompt"] = req.prompt_text
    else:
        kwargs["token_ids"] = list(req.prompt_ids)
    if req.oracle_tokens:
        kwargs["oracle_tokens"] = req.oracle_tokens
    if seed is not None:
        kwargs["seed"] = seed + req.index
    if req.session_id:
        kwargs["session_id"] = req.session_id
    try:
        async for ev in client.generate_stream(**kwargs):
            at = _field(ev, "arrival_s") or time.perf_counter()
            ids = _field(ev, "token_ids") or []
            rec.token_times.extend([at - t0] * len(ids))
            if collect is not None:
                collect.extend(int(t) for t in ids)
            reason = _field(ev, "finish_reason")
            if reason:
                rec.finish_reason = _finish_name(reason)
            usage = _field(ev, "usage")
            if usage is not None and (not hasattr(usage, "ByteSize") or usage.ByteSize()):
                apply_usage(rec, usage)
                if not rec.n_in:  # a text prompt: the router counted its tokens
                    rec.n_in = int(_field(usage, "prompt_tokens", 0) or 0)
        rec.n_out = len(rec.token_times)
        rec.finish_s = time.perf_counter() - t0
        if rec.n_out == 0:
            rec.error = "no tokens received"
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # a failed request is data, not a crash of the benchmark
        rec.error = f"{type(exc).__name__}: {exc}"
        rec.n_out = len(rec.token_times)
    return rec


async def run_load(
    client: StreamingClient,
    requests: Sequence[BenchRequest],
    *,
    temperature: float = 0.0,
    seed: int | None = None,
    progress: bool = True,
    desc: str = "requests",
) -> tuple[list[RequestRecord], float]:
    """Send `requests` at their `arrival_s` offsets; returns (records by index, wall seconds
    from the first send to the last completion)."""
    from tqdm.auto import tqdm

    ordered = sorted(requests, key=lambda r: r.arrival_s)
    bar = tqdm(total=len(ordered), desc=desc, unit="req", disable=not progress)
    tasks: list[asyncio.Task[RequestRecord]] = []
    t0 = time.perf_counter()

    def _done(_: asyncio.Task[RequestRecord]) -> None:
        bar.update(1)

    try:
        for req in ordered:
            delay = t0 + req.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(
                send_one(client, req, t0, temperature=temperature, seed=seed)
            )
            task.add_done_callback(_done)
            tasks.append(task)
        records = list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        bar.close()
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return records, wall


def open_client(addr: str) -> Any:
    """The SDK's AsyncClient (imported lazily: it is written by another module owner)."""
    try:
        from pdserve.client import AsyncClient  # type: ignore[attr-defined]
    except ImportError as exc:
        raise SystemExit(f"pdserve.client.AsyncClient is not available: {exc}") from None
    return AsyncClient(addr)
