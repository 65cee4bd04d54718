"""A per-step log of one engine: when each step ran, what it held and the CPU it took.

Off by default (`--step-log DIR` on a worker). Each worker process appends JSON lines to
`DIR/worker-<pid>.steps.jsonl`, one per step, written by the engine thread:

    {"t0": 1234.5678, "wall_s": 0.0712, "cpu_s": 0.0655, "tokens": 64, "seqs": 1,
     "chunks": 1, "ctx": 64, "pushes": 1}

- `t0`: the step's start on `time.perf_counter()`, CLOCK_MONOTONIC on Linux: the logs of every
  worker on one host share its clock, so one worker's steps can be laid over another's;
- `wall_s`: the step's seconds (as the `engine_step_seconds` counter adds them);
- `cpu_s`: the engine thread's CPU seconds over the step (`time.thread_time`): wall minus CPU
  is time the thread waited (its core taken by another process, or the GIL by a thread of
  its own process);
- `tokens`, `seqs`, `chunks`, `ctx`: the step's new tokens, its sequences, those with more than
  one new token (prompt chunks) and their context after the step (start + new, summed);
- `pushes`: the prompts whose KV the step handed to a push (a disaggregated prefill).

`pdserve.bench.step_log` reads the logs back and lays a prefill's steps over a decode's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import IO

FLUSH_EVERY = 64  # steps between flushes (a killed worker loses at most these)


class StepLog:
    """Appends one JSON line per step; used from the engine thread only."""

    def __init__(self, directory: str | Path) -> None:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path / f"worker-{os.getpid()}.steps.jsonl"
        self._out: IO[str] | None = self.path.open("a", encoding="utf-8")
        self._pending = 0

    def record(self, t0: float, wall_s: float, cpu_s: float, shape: dict[str, int]) -> None:
        if self._out is None:
            return
        line = {"t0": round(t0, 6), "wall_s": round(wall_s, 6), "cpu_s": round(cpu_s, 6)}
        self._out.write(json.dumps(line | shape) + "\n")
        self._pending += 1
        if self._pending >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._out is not None:
            self._out.flush()
            self._pending = 0

    def close(self) -> None:
        if self._out is not None:
            self._out.close()
            self._out = None
