"""A served worker's own engine steps, from its Info counters (`engine_steps`,
`engine_step_seconds`): what its engine spent stepping over a window of a served phase, in
the same minutes as the phase's TPOT.

`pdserve profile` takes the serving stack's work per step as served TPOT minus the engine's
step. Against the engine-only fit, taken minutes earlier, that difference also carried the
machine's drift between the two phases: 0-4.3 ms per step at 1-4 streams over six profiles of
one machine, where the step itself is ~20 ms. The served worker's own steps give the drift in
the same minutes (`serving_work_per_step`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepCounters:
    steps: float
    seconds: float

    def since(self, before: StepCounters) -> StepCounters:
        return StepCounters(self.steps - before.steps, self.seconds - before.seconds)

    @classmethod
    def of(cls, counters: dict[str, float]) -> StepCounters | None:
        """From a worker's Info counters; None when it has none (an engine without them)."""
        if "engine_steps" not in counters:
            return None
        return cls(float(counters["engine_steps"]), float(counters["engine_step_seconds"]))


def read_step_counters(cluster: Any, name: str) -> StepCounters | None:
    """Worker `name`'s engine step counters (`Cluster.worker_counters`); None when it has
    none (an engine without them)."""
    return StepCounters.of(cluster.worker_counters(name))


async def read_step_counters_async(cluster: Any, name: str) -> StepCounters | None:
    """`read_step_counters` off the event loop (its channel is a blocking one)."""
    return await asyncio.to_thread(read_step_counters, cluster, name)


def mean_decode_step_s(
    window: StepCounters | None, prefill_steps: int, prefill_s: float
) -> float | None:
    """The mean decode step of a window of B streams: its steps less the `prefill_steps`
    that computed their prompts (`prefill_s`, from the engine-only fit: a few steps of
    ~50 in the window); None without counters or decode steps."""
    if window is None:
        return None
    steps = window.steps - prefill_steps
    seconds = window.seconds - prefill_s
    if steps < 1 or seconds <= 0:
        return None
    return seconds / steps


def serving_work_per_step(points: list[dict[str, Any]]) -> dict[int, float]:
    """{streams: the serving stack's work per step} from served phases of B streams, each
    {"streams", "tpot_s", "engine_step_s" (the engine-only fit of that batch), "served_step_s"
    (the worker's own mean step, or None)}: TPOT minus the engine-only step x the machine's
    speed now, read at the fewest streams as served step / engine-only step.

    Not TPOT minus the served step: with many streams the step itself slows while the
    worker's threads relay tokens beside it (bench50m fp32, 16 streams: the served step
    32.8 ms, the engine-only one 28.1 ms, where 1-4 streams served within 2 % of it), and
    that is serving work too. With a single stream there is the least of it, so the speed
    read there is the machine's."""
    pts = sorted(points, key=lambda p: p["streams"])
    first = pts[0] if pts else None
    speed = 1.0
    if first and first.get("served_step_s") and first["engine_step_s"] > 0:
        speed = first["served_step_s"] / first["engine_step_s"]
    return {int(p["streams"]): p["tpot_s"] - p["engine_step_s"] * speed for p in pts}
