"""Reading worker step logs (`--step-log DIR`, `engine.step_log`) back: a 1P1D prefill's steps
laid over its decode's on one host's clock.

For each prefill step: the share of its wall time during which the decode was stepping, the
engine thread's CPU seconds and the time it waited (wall - CPU), and, given a step model,
each over the model's seconds for the same step. Grouped by whether the decode stepped
meanwhile and by the prompt's size, this separates a slower core (CPU over the model) from a
core taken away (wait), and both from the decode's share:

    python -m pdserve.bench.step_log DIR [--profile P.json [--run RUN.json --arm NAME]]

With `--run` (a `sim validate --probe` output), the model is the profile's fit scaled as
`sim validate` scales it for that arm: by the arm's engine probe over the profile's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LoggedStep:
    t0: float
    wall_s: float
    cpu_s: float
    tokens: int
    seqs: int
    chunks: int
    ctx: int
    pushes: int

    @property
    def t1(self) -> float:
        return self.t0 + self.wall_s


def read_step_log(path: str | Path) -> list[LoggedStep]:
    """One worker's steps, in order; a torn last line (a killed worker) is skipped."""
    steps = []
    for line in Path(path).read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            continue
        steps.append(LoggedStep(**{k: d[k] for k in LoggedStep.__dataclass_fields__}))
    return steps


def read_step_logs(directory: str | Path) -> dict[str, list[LoggedStep]]:
    """Every worker's steps in `directory`, by file name."""
    return {p.name: read_step_log(p) for p in sorted(Path(directory).glob("*.steps.jsonl"))}


def prefill_and_others(
    logs: dict[str, list[LoggedStep]],
) -> tuple[list[LoggedStep], list[LoggedStep]]:
    """The log with KV pushes (a 1P1D's prefill) and every other worker's steps, by start."""
    pushing = [name for name, steps in logs.items() if any(s.pushes for s in steps)]
    if len(pushing) != 1:
        raise ValueError(f"expected one worker that pushed KV, found {len(pushing)}")
    others = sorted((s for name, steps in logs.items() if name != pushing[0] for s in steps),
                    key=lambda s: s.t0)  # fmt: skip
    return logs[pushing[0]], others


def overlap_shares(steps: Sequence[LoggedStep], others: Sequence[LoggedStep]) -> np.ndarray:
    """Per step of `steps`: the share of its wall time that some step of `others` (which do
    not overlap each other: one worker) was running."""
    o0 = np.array([s.t0 for s in others])
    o1 = o0 + np.array([s.wall_s for s in others])
    out = np.zeros(len(steps))
    for i, s in enumerate(steps):
        both = np.clip(np.minimum(o1, s.t1) - np.maximum(o0, s.t0), 0.0, None)
        out[i] = float(both.sum()) / s.wall_s if s.wall_s > 0 else 0.0
    return out


TOKEN_BINS = ((1, 128), (128, 384), (384, 100_000))


def prefill_report(
    prefill: Sequence[LoggedStep],
    others: Sequence[LoggedStep],
    model_s: Callable[[LoggedStep], float] | None = None,
) -> list[dict[str, float | str]]:
    """Rows of the prefill's one-prompt steps by (the others idle / stepping all along, the
    step's tokens): count, median wall, CPU and wait seconds, and with `model_s` (a step's
    model seconds) the medians of CPU / model and wall / model."""
    ones = [s for s in prefill if s.seqs == 1 and s.chunks == 1]
    shares = overlap_shares(ones, others)
    rows: list[dict[str, float | str]] = []
    for beside, pick in (("idle", shares < 0.05), ("stepping", shares > 0.95)):
        for lo, hi in TOKEN_BINS:
            sel = [s for s, p in zip(ones, pick, strict=True) if p and lo <= s.tokens < hi]
            if not sel:
                continue
            row: dict[str, float | str] = {
                "decode": beside, "tokens": f"{lo}-{hi - 1}", "steps": len(sel),
                "wall_s": statistics.median(s.wall_s for s in sel),
                "cpu_s": statistics.median(s.cpu_s for s in sel),
                "wait_s": statistics.median(s.wall_s - s.cpu_s for s in sel),
            }  # fmt: skip
            if model_s is not None:
                row["cpu_over_model"] = statistics.median(s.cpu_s / model_s(s) for s in sel)
                row["wall_over_model"] = statistics.median(s.wall_s / model_s(s) for s in sel)
            rows.append(row)
    return rows


def model_of_profile(profile: dict[str, Any], factor: float = 1.0) -> Callable[[LoggedStep], float]:
    """A one-prompt step's seconds by a profile's step fit x `factor` (no neighbour, no
    serving extra: the engine's own work)."""
    from pdserve.costmodel.costs import CostModel

    step = CostModel.from_json(profile["costs"]).step
    return lambda s: step.step_s([(s.ctx - s.tokens, s.tokens)]) * factor


def probe_ratio(run: dict[str, Any], arm: str, profile: dict[str, Any]) -> float:
    """The arm's prompt-step probe factor over the profile's own, the factor `sim validate`
    scales the profile's fit by (`cli.sim.calibrated_costs`); the profile must have probed."""
    base = profile.get("probe")
    if not base:
        raise ValueError("the profile has no probe of its own: profile again to compare")
    got = run["sim"][arm]["contention_factors"]["prefill_factor"]
    return float(got) / float(base.get("prefill_factor", base["factor"]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.step_log", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("directory")
    p.add_argument("--profile", help="a `pdserve profile` JSON: its step fit is the model")
    p.add_argument("--run", help="the `sim validate --probe` JSON of the run the logs are of")
    p.add_argument("--arm", default="d11", help="its arm (default d11)")
    args = p.parse_args(argv)
    prefill, others = prefill_and_others(read_step_logs(args.directory))
    model = None
    if args.profile:
        prof = json.loads(Path(args.profile).read_text())
        run = json.loads(Path(args.run).read_text()) if args.run else None
        factor = probe_ratio(run, args.arm, prof) if run else 1.0
        print(f"model: {args.profile}'s step fit x {factor:.3f}")
        model = model_of_profile(prof, factor)
    for row in prefill_report(prefill, others, model):
        ms = {k: f"{float(v) * 1e3:.1f} ms" for k, v in row.items() if k.endswith("_s")}
        ratios = {k: f"{float(v):.3f}" for k, v in row.items() if "over" in k}
        print(f"decode {row['decode']:8s} tokens {row['tokens']:>9s} steps {row['steps']:4d}  "
              + "  ".join(f"{k} {v}" for k, v in (ms | ratios).items()))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
