"""The engine's step log (`--step-log`) and reading it back: a prefill's steps over a decode's."""

from __future__ import annotations

import itertools
import json

import pytest

from pdserve.bench.step_log import (
    LoggedStep,
    overlap_shares,
    prefill_and_others,
    prefill_report,
    read_step_logs,
)
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.engine.step_log import StepLog


def _step(t0: float, wall: float, tokens: int = 1, seqs: int = 1, pushes: int = 0,
          cpu: float | None = None) -> LoggedStep:  # fmt: skip
    return LoggedStep(t0, wall, wall if cpu is None else cpu, tokens, seqs,
                      int(tokens > seqs), tokens, pushes)  # fmt: skip


async def test_the_engine_logs_every_step_with_its_shape_and_cpu(make_engine, tmp_path):
    ae = AsyncEngine(make_engine(), StepLog(tmp_path))
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    async for _ in ae.generate("a", list(range(2, 22)), params):
        pass
    steps_total = ae.steps_total
    await ae.shutdown()  # closes (flushes) the log
    (name, steps), *more = read_step_logs(tmp_path).items()
    assert not more and name.startswith("worker-") and len(steps) == steps_total == 5
    first, *decodes = steps
    assert (first.tokens, first.seqs, first.chunks, first.ctx, first.pushes) == (20, 1, 1, 20, 0)
    assert [(s.tokens, s.chunks, s.ctx) for s in decodes] == [(1, 0, 21 + i) for i in range(4)]
    assert all(s.wall_s > 0 and 0 <= s.cpu_s <= s.wall_s + 2e-3 for s in steps)
    assert all(a.t1 <= b.t0 + 1e-5 for a, b in itertools.pairwise(steps))  # one thread
    assert ae.step_seconds_total == pytest.approx(sum(s.wall_s for s in steps), abs=1e-4)


def test_a_torn_last_line_is_skipped(tmp_path):
    line = {"t0": 1.0, "wall_s": 0.1, "cpu_s": 0.09, "tokens": 8, "seqs": 1, "chunks": 1,
            "ctx": 8, "pushes": 1}  # fmt: skip
    (tmp_path / "worker-1.steps.jsonl").write_text(json.dumps(line) + '\n{"t0": 2.0, "wa')
    assert read_step_logs(tmp_path)["worker-1.steps.jsonl"] == [
        LoggedStep(1.0, 0.1, 0.09, 8, 1, 1, 8, 1)
    ]


def test_the_share_of_each_step_that_the_other_worker_was_stepping():
    mine = [_step(0.0, 1.0), _step(2.0, 1.0), _step(4.0, 0.5)]
    others = [_step(0.5, 0.25), _step(0.9, 0.2), _step(1.9, 2.0)]
    # 0.25 + 0.1 of the first; all of the second; none of the third
    assert overlap_shares(mine, others) == pytest.approx([0.35, 1.0, 0.0])


def test_the_prefill_is_the_worker_that_pushed_and_its_report_splits_by_the_decode():
    prefill = [_step(0.0, 0.05, tokens=64, pushes=1, cpu=0.045),  # decode idle
               _step(1.0, 0.08, tokens=64, pushes=1, cpu=0.060),  # decode stepping
               _step(2.0, 0.30, tokens=400, pushes=1, cpu=0.29)]  # fmt: skip
    decode = [_step(0.9, 0.2, seqs=2, tokens=2)]
    logs = {"worker-1.steps.jsonl": prefill, "worker-2.steps.jsonl": decode}
    assert prefill_and_others(logs) == (prefill, decode)
    with pytest.raises(ValueError, match="found 0"):
        prefill_and_others({"worker-2.steps.jsonl": decode})
    rows = prefill_report(prefill, decode, model_s=lambda s: s.tokens / 1000)
    by = {(r["decode"], r["tokens"]): r for r in rows}
    assert set(by) == {("idle", "1-127"), ("idle", "384-99999"), ("stepping", "1-127")}
    idle, busy = by[("idle", "1-127")], by[("stepping", "1-127")]
    assert idle["wait_s"] == pytest.approx(0.005) and busy["wait_s"] == pytest.approx(0.02)
    assert busy["cpu_over_model"] == pytest.approx(0.060 / 0.064)
    assert by[("idle", "384-99999")]["wall_over_model"] == pytest.approx(0.75)


def test_a_step_log_left_open_by_a_killed_worker_keeps_all_but_its_last_records(tmp_path):
    log = StepLog(tmp_path)
    shape = {"tokens": 1, "seqs": 1, "chunks": 0, "ctx": 5, "pushes": 0}
    for i in range(70):  # one flush at 64
        log.record(float(i), 0.01, 0.01, shape)
    assert len(read_step_logs(tmp_path)[log.path.name]) == 64
    log.close()
    assert len(read_step_logs(tmp_path)[log.path.name]) == 70
    log.record(99.0, 0.01, 0.01, shape)  # after close: ignored, no error


def test_the_report_command_scales_the_profiles_fit_by_the_arms_probe(tmp_path, capsys):
    from pdserve.bench.step_log import main

    def write(name: str, steps: list[LoggedStep]) -> None:
        lines = [json.dumps({k: getattr(s, k) for k in LoggedStep.__dataclass_fields__})
                 for s in steps]  # fmt: skip
        (tmp_path / name).write_text("\n".join(lines) + "\n")

    write("worker-1.steps.jsonl", [_step(0.0, 0.06, tokens=50, pushes=1, cpu=0.05)])
    write("worker-2.steps.jsonl", [_step(1.0, 0.02)])
    profile = tmp_path / "prof.json"
    profile.write_text(json.dumps({"costs": {"step": {"base_s": 0.0, "per_token_s": 0.001}},
                                   "probe": {"factor": 1.0, "prefill_factor": 1.1}}))  # fmt: skip
    run = tmp_path / "run.json"
    run.write_text(json.dumps({"sim": {"d11": {"contention_factors": {"prefill_factor": 1.32}}}}))
    assert main([str(tmp_path), "--profile", str(profile), "--run", str(run)]) == 0
    out = capsys.readouterr().out
    # the model: 50 ms x 1.32 / 1.1 = 60 ms; CPU 50 ms of it, wall 60 ms
    assert "x 1.200" in out and "cpu_over_model 0.833" in out and "wall_over_model 1.000" in out
