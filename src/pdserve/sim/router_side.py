"""The router's decision objects for a simulated cluster, built from `RouterSettings` the way
`RouterApp` builds them (`_predictor`, `_length_scheduling`, `_flip_controller`'s thresholds),
so a `--router-arg=...` flag means the same here as in `pdserve up`.

Nothing here decides anything: `LengthScheduling` (predict, headroom, placed/progress/done),
`OverloadQueue` (SJF with aging or FCFS), `DecodeDemand`, `make_policy` (count or predicted
decode placement) and the predictors are the router's own classes. The simulator drives the
two async entry points (`LengthScheduling.predict`, whose text featurisation goes to a thread,
and `OverloadQueue.acquire`) on a private asyncio loop (`AsyncDriver`); their results feed the
simulator's event heap, so the simulated time stays the only clock the decisions read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

from pdserve.config import load_settings
from pdserve.router.demand import DecodeDemand
from pdserve.router.flip_policy import FlipThresholds
from pdserve.router.length import LengthScheduling
from pdserve.router.overload_queue import OverloadQueue
from pdserve.router.predictor import EwmaPredictor, OraclePredictor, OutputLengthPredictor
from pdserve.router.settings import RouterSettings


def router_settings(argv: list[str] | None = None) -> RouterSettings:
    """RouterSettings from router flags (`--router-arg` values), as the router parses them
    (environment `PDSERVE_*` included, like the router process)."""
    return load_settings(RouterSettings, list(argv or []), exit_on_error=False)


def consumes_prediction(s: RouterSettings) -> bool:
    """Whether any decision reads the length prediction: predicted decode placement, KV
    headroom, an SJF overload queue, or the flip controller (its decode pressure reads the
    predicted demand). Otherwise the simulator runs no predictor at all."""
    return (
        s.decode_placement == "predicted"
        or s.reserve_max_tokens > 0
        or (s.queue_max_running_per_decode > 0 and s.queue_order == "sjf")
        or s.flip_enabled
    )


_PREDICTOR_CACHE: dict[str, Any] = {}


def build_predictor(s: RouterSettings) -> OutputLengthPredictor:
    """`RouterApp._predictor`: ewma, or online (+ the shipped text model unless 'none'),
    wrapped by the oracle in benchmark oracle mode. The text model is loaded once per path
    (read-only; every simulated run gets a fresh online predictor around it)."""
    predictor: OutputLengthPredictor
    if s.predictor == "ewma":
        predictor = EwmaPredictor(alpha=s.predictor_alpha, initial=s.predictor_initial)
    else:
        from pdserve.router.predictor.offline import DEFAULT_DIR, TextLengthModel
        from pdserve.router.predictor.online import OnlineLengthPredictor

        text_model = None
        if s.predictor_path != "none":
            path = str(s.predictor_path or DEFAULT_DIR)
            if path not in _PREDICTOR_CACHE:
                _PREDICTOR_CACHE[path] = TextLengthModel.load(path)
            text_model = _PREDICTOR_CACHE[path]
        predictor = OnlineLengthPredictor(text_model, initial=s.predictor_initial)
    return OraclePredictor(predictor) if s.predictor_oracle else predictor


def build_length(
    s: RouterSettings,
    predictor: OutputLengthPredictor,
    demand: DecodeDemand,
    queue_limit: Callable[[], int],
    clock: Callable[[], float],
) -> LengthScheduling:
    """`RouterApp._length_scheduling` with the simulated clock and no Prometheus metrics."""
    queue = None
    if s.queue_max_running_per_decode > 0:
        queue = OverloadQueue(
            queue_limit,
            order=s.queue_order,
            aging_tokens_per_s=s.queue_aging_tokens_per_s,
            max_wait_s=s.queue_max_wait_s,
            max_bypass=s.queue_max_bypass,
            clock=clock,
        )
    return LengthScheduling(
        predictor,
        demand=demand,
        queue=queue,
        reserve_max_tokens=s.reserve_max_tokens,
        oracle=s.predictor_oracle,
        use_max_tokens=s.predictor_use_max_tokens,
    )


def flip_thresholds(s: RouterSettings) -> FlipThresholds:
    """`RouterApp._flip_controller`'s thresholds."""
    return FlipThresholds(
        prefill_tokens_full=s.flip_prefill_tokens,
        decode_seqs_full=s.flip_decode_seqs,
        starved=s.flip_starved,
        ratio=s.flip_ratio,
        ticks=s.flip_ticks,
        cooldown_s=s.flip_cooldown_s,
    )


class AsyncDriver:
    """Runs the router's coroutines to completion between simulated events.

    `run(coro)` returns its result (a coroutine that awaits only a thread, like `predict`).
    `start(coro, done)` starts one that may wait on other events (`OverloadQueue.acquire`);
    after each `pump()` the finished ones' `done` callbacks run in the order they finished
    (asyncio's ready queue is FIFO, so the order is the order the queue let them in)."""

    PUMP_ROUNDS = 4  # future set -> task step -> coroutine returns -> done callback

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
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


async def _yield() -> None:
    await asyncio.sleep(0)
