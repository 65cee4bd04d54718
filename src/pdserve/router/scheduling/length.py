"""Length-aware scheduling around a request's lifecycle, once per client request (a
migrated stream keeps its request's prediction; its continuations are not new requests):

predict   -> a LengthQuery from what the router knows (prompt text or tokens,
             model, max_tokens, session, block-hash prefix; the true length only
             in oracle mode) and the predictor's p50/p90 -> a `Prediction`. Skipped
             (no estimate, nothing learned) when nothing reads it (`needed=False`).
route     -> an attempt's RouteRequest filled in: predicted_tokens (p50 minus the
             tokens already streamed: placement, demand) and reserve_tokens (decode KV
             headroom = min(p90 left, max_tokens left, reserve_max_tokens))
placed    -> the decode's predicted demand (demand.DecodeDemand)
progress  -> tokens streamed so far (the demand shrinks as the request runs)
left      -> an attempt ended: its demand leaves the decode
done      -> the request ended: a finished request's whole output length is learned
             online and scored (metrics, running Kendall tau)

The admission queue that orders requests by the prediction is admission.py's.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.logging import get_logger
from pdserve.rpc.metrics import Metrics

from .demand import DecodeDemand
from .policies import RouteRequest
from .predictor import LengthEstimate, LengthQuery, OutputLengthPredictor
from .predictor.stats import kendall_tau

if TYPE_CHECKING:
    from ..job import Job

log = get_logger("pdserve.router.scheduling.length")

UNBOUNDED = 1 << 30
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_LOG2_ERR_BUCKETS = (-4, -3, -2, -1.5, -1, -0.5, -0.25, 0, 0.25, 0.5, 1, 1.5, 2, 3, 4)


class LengthMetrics:
    def __init__(self, metrics: Metrics) -> None:
        m = metrics
        self.log2_error = m.histogram(
            "router_length_prediction_log2_error",
            "log2(actual / predicted p50) of finished requests' output length",
            buckets=_LOG2_ERR_BUCKETS,
        )
        self.predicted = m.histogram(
            "router_length_predicted_tokens", "predicted p50 output tokens", buckets=_TOKEN_BUCKETS
        )
        self.actual = m.histogram(
            "router_length_actual_tokens", "actual output tokens", buckets=_TOKEN_BUCKETS
        )
        self.p90_covered = m.counter(
            "router_length_p90_covered", "finished requests whose length was <= predicted p90"
        )
        self.tau = m.gauge(
            "router_length_running_kendall_tau",
            "Kendall tau of predicted p50 vs actual over the recent window",
        )
        self.predicted_kv = m.gauge(
            "router_decode_predicted_kv_tokens",
            "predicted peak KV tokens of what the router placed on a decode instance",
            ["instance"],
        )


@dataclass
class Prediction:
    """One client request's output-length prediction (made once, before admission)."""

    request_id: str  # the client request's (worker) id; continuations keep it
    query: LengthQuery
    estimate: LengthEstimate
    max_tokens: int  # the request's own max_tokens (a continuation's is what is left)
    predicted_tokens: int  # p50, clamped: the admission queue's order, placement
    predicted_p90: int
    estimated: bool = True  # False: nothing reads predictions, none was made
    t0: float = field(default_factory=time.monotonic)


class LengthScheduling:
    def __init__(
        self,
        predictor: OutputLengthPredictor,
        *,
        demand: DecodeDemand | None = None,
        needed: bool | Callable[[], bool] = True,
        reserve_max_tokens: int = 0,
        oracle: bool = False,
        use_max_tokens: bool = True,
        metrics: LengthMetrics | None = None,
        window: int = 512,
    ) -> None:
        self.predictor = predictor
        self.demand = demand if demand is not None else DecodeDemand()
        # False: nothing reads predictions (FCFS or no queue, count placement, no KV
        # headroom): skip the estimate (milliseconds of text featurizing) and the learning.
        # A callable is asked per request (length routing reads them only while the decode
        # pool's memory is mixed).
        self.needed = needed
        self.reserve_max_tokens = reserve_max_tokens
        self.oracle = oracle
        # False: the predictor does not see max_tokens (benchmarks whose max_tokens is the
        # true length would otherwise leak it); the KV headroom is still capped by it.
        self.use_max_tokens = use_max_tokens
        self.metrics = metrics
        self._pairs: deque[tuple[float, float]] = deque(maxlen=window)
        self._gauged: set[str] = set()  # decode ids with a predicted-KV series
        self.learned = 0

    def is_needed(self) -> bool:
        return self.needed() if callable(self.needed) else self.needed

    # -- before placement
    def query(self, job: Job, route: RouteRequest, block_size: int) -> LengthQuery:
        return LengthQuery(
            num_prompt_tokens=len(job.token_ids),
            max_tokens=job.params.max_tokens if self.use_max_tokens else UNBOUNDED,
            model=job.model,
            text=job.prompt_text,
            block_hashes=tuple(route.hashes_for(block_size)) if block_size else (),
            session_id=job.session_id,
            oracle_tokens=job.oracle_tokens if self.oracle else 0,
        )

    async def predict(
        self, job: Job, route: RouteRequest, block_size: int, needed: bool | None = None
    ) -> Prediction:
        """`needed`: `is_needed()` when the caller just asked it (None: asked here)."""
        if not (self.is_needed() if needed is None else needed):
            # (no prompt hashing either: nothing reads the query)
            n = job.params.max_tokens
            est = LengthEstimate(float(n), float(n), "unused")
            return Prediction(job.request_id, self.query(job, route, 0), est, n, n, n, False)
        q = self.query(job, route, block_size)
        try:
            if q.text:  # featurizing text takes milliseconds: off the event loop
                est = await asyncio.to_thread(self.predictor.estimate, q)
            else:
                est = self.predictor.estimate(q)
        except Exception:  # a predictor bug must not fail requests
            log.exception("length prediction failed")
            est = LengthEstimate(q.max_tokens, q.max_tokens, "error")
        est = est.clamp(q.max_tokens)
        p50 = est.tokens(q.max_tokens)
        p90 = max(p50, math.ceil(est.p90))
        return Prediction(job.request_id, q, est, job.params.max_tokens, p50, p90)

    def route(self, pred: Prediction, job: Job, route: RouteRequest) -> RouteRequest:
        """Fill in an attempt's route from the request's prediction. `job` is the request
        or a continuation of it, which owes `job.params.max_tokens` of `pred.max_tokens`."""
        done = max(0, pred.max_tokens - job.params.max_tokens)  # streamed before this attempt
        route.predicted_tokens = max(1, pred.predicted_tokens - done)
        route.predicted_p90 = max(route.predicted_tokens, pred.predicted_p90 - done)
        if self.reserve_max_tokens > 0:
            route.reserve_tokens = min(
                route.predicted_p90, self.reserve_max_tokens, job.params.max_tokens
            )
        return route

    # -- while it runs
    def placed(self, pred: Prediction, instance_id: str, prompt_tokens: int, route: RouteRequest):
        self.demand.add(pred.request_id, instance_id, prompt_tokens, route.predicted_tokens)

    def progress(self, pred: Prediction, new_tokens: int) -> None:
        self.demand.progress(pred.request_id, new_tokens)

    def left(self, pred: Prediction) -> None:
        """An attempt ended: what it placed on its decode is gone from there."""
        self.demand.remove(pred.request_id)

    def done(self, pred: Prediction, completion_tokens: int, finished: bool) -> None:
        """The request ended; `completion_tokens` counts all of its attempts."""
        self.demand.remove(pred.request_id)
        if not finished or completion_tokens <= 0 or not pred.estimated:
            return  # cancelled or failed: the length is unknown (censored)
        try:
            self.predictor.learn(pred.query, completion_tokens)
        except Exception:
            log.exception("length predictor failed to learn")
        self.learned += 1
        self._pairs.append((pred.estimate.p50, float(completion_tokens)))
        if self.metrics is not None:
            m = self.metrics
            m.log2_error.observe(math.log2(completion_tokens / max(1.0, pred.estimate.p50)))
            m.predicted.observe(pred.estimate.p50)
            m.actual.observe(completion_tokens)
            if completion_tokens <= pred.estimate.p90:
                m.p90_covered.inc()

    # -- introspection
    def running_tau(self) -> float:
        if len(self._pairs) < 2:
            return 0.0
        p, a = zip(*self._pairs, strict=True)
        tau = kendall_tau(p, a)
        if self.metrics is not None:
            self.metrics.tau.set(tau)
        return tau

    def refresh_gauges(self, decode_ids: list[str]) -> None:
        """Per-decode predicted KV gauges; an instance that left (or stopped decoding) loses
        its series, so no gauge outlives the instance it describes."""
        if self.metrics is not None:
            gauge = self.metrics.predicted_kv
            for gone in self._gauged - set(decode_ids):
                try:
                    gauge.remove(gone)
                except KeyError:
                    pass
            self._gauged = set(decode_ids)
            for iid in decode_ids:
                gauge.labels(iid).set(self.demand.footprint(iid))
            self.running_tau()
