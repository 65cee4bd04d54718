"""Stepping an engine to measure it: on a thread of its own, as the worker steps its engine,
each step timed with the batch its scheduler planned."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def recorded_batches(engine: Any) -> Iterator[list[list[tuple[int, int]]]]:
    """While inside, every step's scheduled batch, [(start, num_new_tokens)], is appended to
    the list yielded (the engine's scheduler is wrapped, and restored on exit)."""
    sched = engine.scheduler
    orig = sched.schedule
    batches: list[list[tuple[int, int]]] = []

    def schedule():
        plan = orig()
        batches.append([(e.start, e.num_new_tokens) for e in plan.scheduled])
        return plan

    sched.schedule = schedule
    try:
        yield batches
    finally:
        sched.schedule = orig


def timed_steps(
    engine: Any,
    samples: list[dict[str, Any]],
    label: str,
    max_steps: int = 10_000,
    tick: Callable[[], float] = time.perf_counter,
):
    """Step `engine` until idle, recording (batch, seconds) of every step (`tick`: the
    clock; `time.thread_time` measures the engine thread's CPU time instead of wall time)."""
    with recorded_batches(engine) as last:
        for _ in range(max_steps):
            if not engine.has_unfinished_requests():
                break
            t0 = tick()
            engine.step()
            dt = tick() - t0
            batch = last[-1] if last else []
            if batch:
                samples.append({"kind": label, "batch": batch, "s": dt})


def on_engine_thread(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` on a thread of its own, as the worker steps its engine (its
    engine thread), and its result (or its exception). On the main thread glibc's allocator
    gives a large step's activations back to the kernel after each step, and the next step
    faults them in again: a 512-token prompt step of bench50m fp32 took 64,769 minor page
    faults and 463 ms there against 4,443 faults and 353 ms on another thread (served:
    360 ms), so a profile stepped on the main thread charges long prompts what the server
    does not pay."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = fn(*args, **kwargs)
        except BaseException as exc:  # re-raised on the caller's thread
            box["exc"] = exc

    t = threading.Thread(target=run, name="profile-engine")
    t.start()
    t.join()
    if "exc" in box:
        raise box["exc"]
    return box["out"]
