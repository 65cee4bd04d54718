"""Each run of a rate sweep sends its own prompts: identical prompts would hit the prefix cache
left by the previous run and flatter every rate after the first."""

from __future__ import annotations

from pdserve.cli.main import build_parser
from pdserve.workload.spec import workload_at

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n"


def _args(*extra: str):
    return build_parser().parse_args(
        ["bench", "serve", "--addr", "127.0.0.1:1", "--vocab-size", "1000", *extra]
    )


def test_sweep_runs_get_distinct_prompts_same_lengths(tmp_path):
    trace = tmp_path / "azure.csv"
    rows = [f"2023-11-16 18:15:{i:02d}.000,{40 + i},{5 + i}" for i in range(6)]
    trace.write_text(AZURE + "\n".join(rows) + "\n")
    args = _args("--trace", str(trace))
    run0, run1 = workload_at(args, 1.0, salt=0), workload_at(args, 2.0, salt=1)
    assert [len(r.prompt_ids) for r in run0] == [len(r.prompt_ids) for r in run1]
    assert [r.max_tokens for r in run0] == [r.max_tokens for r in run1]
    assert all(a.prompt_ids[:16] != b.prompt_ids[:16] for a, b in zip(run0, run1, strict=True))
    assert workload_at(args, 1.0, salt=0)[0].prompt_ids == run0[0].prompt_ids  # still seeded


def test_synthetic_sweep_runs_differ():
    args = _args("--num-requests", "4", "--input-len", "fixed:32", "--output-len", "fixed:4")
    run0, run1 = workload_at(args, 1.0, salt=0), workload_at(args, 1.0, salt=1)
    assert all(a.prompt_ids != b.prompt_ids for a, b in zip(run0, run1, strict=True))
