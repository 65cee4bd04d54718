"""The router's decision objects for a simulated cluster, built from `RouterSettings` the way
`RouterApp` builds them (`admission_config`, `predictions_needed`, `_predictor`,
`_length_scheduling`, `_flip_controller`'s thresholds), so a `--router-arg=...` flag means the
same here as in `pdserve up`.

Nothing here decides anything: `Admission` (the one admission stage: the router-wide running
limit and its `OverloadQueue`, SJF with aging or FCFS, bounded and timed), `LengthScheduling`
(predict, route: placement prediction and KV headroom, placed/progress/left/done),
`DecodeDemand`, `make_policy` (count or predicted decode placement) and the predictors are the
router's own classes. The simulator drives the async entry points (`LengthScheduling.predict`,
whose text featurisation goes to a thread, and `Admission.admit` / `Pass.turn`) on a private
asyncio loop whose clock is the simulated one (`AsyncDriver`); their results feed the
simulator's event heap, so the simulated time stays the only clock the decisions read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import CollectorRegistry

from pdserve.config import load_settings
from pdserve.router.app import admission_config, predictions_needed
from pdserve.router.flip.policy import FlipThresholds
from pdserve.router.scheduling.admission import Admission
from pdserve.router.scheduling.demand import DecodeDemand
from pdserve.router.scheduling.length import LengthScheduling
from pdserve.router.scheduling.predictor import (
    EwmaPredictor,
    OraclePredictor,
    OutputLengthPredictor,
)
from pdserve.router.settings import RouterSettings
from pdserve.rpc.metrics import Metrics


def router_settings(argv: list[str] | None = None) -> RouterSettings:
    """RouterSettings from router flags (`--router-arg` values), as the router parses them
    (environment `PDSERVE_*` included, like the router process)."""
    return load_settings(RouterSettings, list(argv or []), exit_on_error=False)


def admission_limited(s: RouterSettings) -> bool:
    """Whether the admission stage can make a request wait (a router-wide running limit)."""
    return s.admission.max_running > 0 or s.admission.queue_max_running_per_decode > 0


def build_admission(
    s: RouterSettings, serving: Callable[[], int], clock: Callable[[], float]
) -> Admission:
    """`RouterApp._admission` with the simulated clock (metrics on a private registry)."""
    metrics = Metrics(CollectorRegistry())
    return Admission(metrics, admission_config(s), serving=serving, clock=clock)


_PREDICTOR_CACHE: dict[str, Any] = {}


def build_predictor(s: RouterSettings) -> OutputLengthPredictor:
    """`RouterApp._predictor`: ewma, or online (+ the shipped text model unless 'none'),
    wrapped by the oracle in benchmark oracle mode. The text model is loaded once per path
    (read-only; every simulated run gets a fresh online predictor around it)."""
    predictor: OutputLengthPredictor
    ls = s.length
    if ls.predictor == "ewma":
        predictor = EwmaPredictor(alpha=ls.predictor_alpha, initial=ls.predictor_initial)
    else:
        from pdserve.router.scheduling.predictor.offline import DEFAULT_DIR, TextLengthModel
        from pdserve.router.scheduling.predictor.online import OnlineLengthPredictor

        text_model = None
        if ls.predictor_path != "none":
            path = str(ls.predictor_path or DEFAULT_DIR)
            if path not in _PREDICTOR_CACHE:
                _PREDICTOR_CACHE[path] = TextLengthModel.load(path)
            text_model = _PREDICTOR_CACHE[path]
        predictor = OnlineLengthPredictor(text_model, initial=ls.predictor_initial)
    return OraclePredictor(predictor) if ls.predictor_oracle else predictor


def build_length(
    s: RouterSettings, predictor: OutputLengthPredictor, demand: DecodeDemand
) -> LengthScheduling:
    """`RouterApp._length_scheduling` without Prometheus metrics."""
    return LengthScheduling(
        predictor,
        demand=demand,
        needed=predictions_needed(s),
        reserve_max_tokens=s.placement.reserve_max_tokens,
        oracle=s.length.predictor_oracle,
        use_max_tokens=s.length.predictor_use_max_tokens,
    )


def flip_thresholds(s: RouterSettings) -> FlipThresholds:
    """`RouterApp._flip_controller`'s thresholds."""
    f = s.flip
    return FlipThresholds(
        prefill_tokens_full=f.flip_prefill_tokens,
        decode_seqs_full=f.flip_decode_seqs,
        starved=f.flip_starved,
        ratio=f.flip_ratio,
        ticks=f.flip_ticks,
        cooldown_s=f.flip_cooldown_s,
    )


class AsyncDriver:
    """Runs the router's coroutines to completion between simulated events.

    `run(coro)` returns its result (a coroutine that awaits only a thread, like `predict`).
    `start(coro, done)` starts one that may wait on other events (`Pass.turn`); after each
    `pump()` the finished ones' `done` callbacks run in the order they finished (asyncio's
    ready queue is FIFO, so the order is the order the queue let them in). The loop's clock
    is `clock` (simulated time), so the router's `asyncio.timeout`s (the admission queue's
    `queue_timeout_s`) expire in simulated time, at the first pump at or after it."""

    PUMP_ROUNDS = 4  # future set -> task step -> coroutine returns -> done callback

    def __init__(self, clock: Callable[[], float] | None = None) -> None:
        self._loop = _SimClockLoop(clock) if clock is not None else asyncio.new_event_loop()
        self._finished: list[Callable[[], None]] = []
        self._live = 0

    def run(self, coro: Coroutine[Any, Any, Any], needs_loop: bool = True) -> Any:
        """`needs_loop=False`: the caller knows it never suspends (`predict` without text
        awaits nothing), so it is stepped once, without a loop round trip."""
        if needs_loop:
            return self._loop.run_until_complete(coro)
        try:
            coro.send(None)
        except StopIteration as stop:
            return stop.value
        coro.close()
        raise RuntimeError("AsyncDriver.run: the coroutine suspended")

    def start(self, coro: Coroutine[Any, Any, Any], done: Callable[[], None]) -> None:
        task = self._loop.create_task(coro)
        self._live += 1

        def finished(t: asyncio.Task) -> None:
            self._live -= 1
            t.result()  # re-raise a bug in the router's code
            self._finished.append(done)

        task.add_done_callback(finished)
        self.pump()

    def pump(self) -> None:
        if not self._live and not self._finished:
            return
        for _ in range(self.PUMP_ROUNDS):
            self._loop.run_until_complete(_yield())
        ready, self._finished = self._finished, []
        for cb in ready:
            cb()

    def close(self) -> None:
        for task in asyncio.all_tasks(self._loop):
            task.cancel()
        if not self._loop.is_closed():
            self._loop.run_until_complete(_yield())
            self._loop.close()


class _SimClockLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is the simulator's (it is only ever pumped, never waits)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self._sim_clock = clock

    def time(self) -> float:
        return self._sim_clock()


async def _yield() -> None:
    await asyncio.sleep(0)
