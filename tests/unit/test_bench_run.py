"""The load generator, `bench serve` and multi-turn sessions driven by a fake SDK client
(no cluster): request contents, records, the JSON result and the plots."""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from pdserve.bench import multiturn, serve
from pdserve.bench.loadgen import run_load
from pdserve.bench.sessions import SessionPlan, run_sessions, turn_report
from pdserve.workload.requests import BenchRequest

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@dataclass
class Ev:
    token_ids: list[int]
    arrival_s: float
    finish_reason: str | None = None
    usage: Any = None


@dataclass
class FakeClient:
    """Streams max_tokens tokens (2 per message after the first); caches per session the
    previous conversation so cached_tokens behaves like a prefix cache with 16-token blocks."""

    fail_index: int | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)
    history: dict[str, list[int]] = field(default_factory=dict)

    async def __aenter__(self) -> FakeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def generate_stream(
        self, *, token_ids, max_tokens, temperature, ignore_eos, seed=None, session_id=None
    ):
        self.calls.append(
            dict(
                token_ids=token_ids,
                max_tokens=max_tokens,
                seed=seed,
                ignore_eos=ignore_eos,
                session_id=session_id,
            )
        )
        if self.fail_index is not None and seed is not None and seed == self.fail_index:
            raise RuntimeError("worker died")
        prev = self.history.get(session_id or "", [])
        shared = 0
        while shared < min(len(prev), len(token_ids)) and prev[shared] == token_ids[shared]:
            shared += 1
        cached = shared // 16 * 16
        await asyncio.sleep(0.002)
        out = [(7 * i + len(token_ids)) % 50 + 10 for i in range(max_tokens)]
        yield Ev(out[:1], time.perf_counter())
        for i in range(1, max_tokens, 2):
            await asyncio.sleep(0.001)
            last = i + 2 >= max_tokens
            usage = {
                "cached_tokens": cached,
                "stages": {
                    "prefill_ms": 2.0,
                    "decode_ms": 3.0,
                    "transfer_ms": 0.5,
                    "transfer_bytes": 4096,
                    "queue_ms": 0.1,
                },
            }
            yield Ev(
                out[i : i + 2],
                time.perf_counter(),
                "length" if last else None,
                usage if last else None,
            )
        if session_id:
            self.history[session_id] = list(token_ids) + out


def test_run_load_sends_every_request_with_its_tokens():
    reqs = [
        BenchRequest(i, [10 + i] * (3 + i), max_tokens=4, arrival_s=0.002 * i) for i in range(5)
    ]
    client = FakeClient(fail_index=3)
    records, wall = asyncio.run(run_load(client, reqs, seed=0, progress=False))
    assert wall > 0 and [r.index for r in records] == list(range(5))
    assert sorted(len(c["token_ids"]) for c in client.calls) == [3, 4, 5, 6, 7]
    assert all(c["ignore_eos"] and c["max_tokens"] == 4 for c in client.calls)
    ok = [r for r in records if r.ok]
    assert len(ok) == 4 and "worker died" in records[3].error
    for r in ok:
        assert r.n_out == 4 and len(r.token_times) == 4
        assert r.finish_reason == "length" and r.stages["transfer_bytes"] == 4096
        assert r.send_s >= r.arrival_s and r.ttft_s > 0 and r.tpot_s is not None


def parse(module, argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    module.add_parser(p.add_subparsers())
    return p.parse_args(argv)


def test_serve_sweep_writes_json_and_pngs(tmp_path, monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(serve, "open_client", lambda addr: client)
    out = tmp_path / "run.json"
    args = parse(
        serve,
        [
            "serve",
            "--num-requests",
            "6",
            "--input-len",
            "uniform:4,12",
            "--output-len",
            "fixed:3",
            "--vocab-size",
            "64",
            "--goodput",
            "ttft:5000",
            "tpot:5000",
            "--sweep-rates",
            "40,80",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert args.func(args) == 0
    assert len(client.calls) == 2 + 6 + 6  # warm-up, then one run per rate
    assert max(c["max_tokens"] for c in client.calls[:2]) <= 3
    data = json.loads(out.read_text())
    assert set(data) >= {"config", "summary", "goodput", "sweep"}
    assert [s["rate"] for s in data["sweep"]] == [40.0, 80.0]
    assert len(data["sweep"][0]["records"]) == 6
    rec = data["sweep"][0]["records"][0]
    assert {"arrival_s", "token_times", "n_in", "n_out", "cached_tokens", "stages"} <= set(rec)
    assert data["goodput"]["distserve"]["max_rate"] == 80.0
    assert data["summary"]["completed"] == 6
    plots = tmp_path / "run_plots"
    for name in ("cdf_ttft.png", "cdf_tpot.png", "cdf_e2e.png", "attainment.png"):
        assert (plots / name).read_bytes()[:8] == PNG_MAGIC


def test_serve_trace_replay_is_prefix_sharing(tmp_path, monkeypatch):
    client = FakeClient()
    monkeypatch.setattr(serve, "open_client", lambda addr: client)
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"timestamp": 0, "input_length": 1024, "output_length": 16, "hash_ids": [0, 1]}\n'
        '{"timestamp": 10, "input_length": 1024, "output_length": 16, "hash_ids": [0, 2]}\n'
    )
    args = parse(
        serve,
        [
            "serve",
            "--trace",
            str(trace),
            "--length-scale",
            "0.0625",
            "--time-scale",
            "0.001",
            "--vocab-size",
            "64",
            "--warmup",
            "0",
            "--out",
            str(tmp_path / "r.json"),
            "--no-progress",
        ],
    )
    assert args.func(args) == 0
    a, b = sorted((c["token_ids"] for c in client.calls), key=len)
    assert len(a) == len(b) == 64 and a[:32] == b[:32] and a[32:] != b[32:]


def test_sessions_extend_the_conversation_and_report_hits():
    plan = SessionPlan(
        num_sessions=3,
        turns=3,
        first_len=40,
        user_len=8,
        output_len=4,
        think_time_s=0.001,
        ramp_s=0.002,
        vocab_size=64,
        seed=1,
    )
    client = FakeClient()
    records, _ = asyncio.run(run_sessions(client, plan, progress=False))
    assert len(records) == 9
    by_session: dict[str, list[list[int]]] = {}
    for c in client.calls:
        by_session.setdefault(c["session_id"], []).append(c["token_ids"])
    for prompts in by_session.values():
        assert [len(p) for p in prompts] == [40, 52, 64]  # + 4 answer + 8 user tokens
        assert prompts[1][:40] == prompts[0] and prompts[2][:52] == prompts[1]
    rep = turn_report(records)
    assert rep["turn1"]["hit_rate"] == 0.0
    # turn 2 reuses 32 of 52 tokens, turn 3 reuses 48 of 64 (16-token blocks)
    assert rep["turns2plus"]["hit_rate"] == pytest.approx((32 + 48) / (52 + 64))
    assert rep["turns2plus"]["ttft_ms"]["count"] == 6


def test_multiturn_cli_sessions(tmp_path, monkeypatch):
    monkeypatch.setattr(multiturn, "open_client", lambda addr: FakeClient())
    out = tmp_path / "mt.json"
    args = parse(
        multiturn,
        [
            "multiturn",
            "--sessions",
            "2",
            "--turns",
            "2",
            "--first-len",
            "20",
            "--user-len",
            "4",
            "--output-len",
            "2",
            "--think-time",
            "0.001",
            "--ramp",
            "0",
            "--vocab-size",
            "64",
            "--out",
            str(out),
            "--no-progress",
        ],
    )
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    assert data["mode"] == "sessions" and len(data["records"]) == 4
    assert data["report"]["turns2plus"]["hit_rate"] == pytest.approx(16 / 26)
