"""Online length prediction from the deployment's own finished requests.

Log-space estimate = prior + per-model drift, pulled toward a prefix memory:
- prior: the offline text model when the request has text, else the running
  mean of log lengths for the model (cold start: `initial`);
- per-model calibration: an EWMA of (log actual - log text prior) per model,
  so a served model that answers longer or shorter than the training data, or
  drifts, is corrected (decay `drift_alpha`); without text the per-model mean
  is itself an EWMA, so it follows drift directly;
- prefix memory: every chained block hash of a finished request's prompt (and
  its session id) remembers an EWMA of log lengths and a count; a new request
  takes the deepest remembered prefix levels and blends their means with the
  prior by count (templated and multi-turn traffic repeats). Bounded LRU.
- spread: an EWMA of squared residuals per model gives p90.
A window of (predicted, actual) pairs yields the running Kendall tau."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from .base import LengthEstimate, LengthQuery, OutputLengthPredictor
from .offline import TextLengthModel
from .stats import kendall_tau

Z90 = 1.2815515655446004


@dataclass
class _Stat:
    n: float = 0.0
    mean: float = 0.0
    var: float = 0.0

    def add(self, x: float, alpha: float) -> None:
        self.n += 1.0
        a = max(alpha, 1.0 / self.n)
        d = x - self.mean
        self.mean += a * d
        self.var = (1.0 - a) * (self.var + a * d * d)


class OnlineLengthPredictor(OutputLengthPredictor):
    name = "online"

    def __init__(
        self,
        text_model: TextLengthModel | None = None,
        *,
        initial: float = 64.0,
        prefix_capacity: int = 200_000,
        prefix_alpha: float = 0.01,
        prefix_strength: float = 0.5,
        prefix_levels: int = 1,
        drift_alpha: float = 0.02,
        drift_prior_n: float = 50.0,
        window: int = 512,
    ) -> None:
        self.text_model = text_model
        self.initial = initial
        self.prefix_capacity = prefix_capacity
        self.prefix_alpha = prefix_alpha
        self.prefix_strength = prefix_strength
        self.prefix_levels = prefix_levels
        self.drift_alpha = drift_alpha
        self.drift_prior_n = drift_prior_n
        self._prefix: OrderedDict[object, _Stat] = OrderedDict()
        self._model_prior: dict[str, _Stat] = {}  # log length per model (no text)
        self._drift: dict[str, _Stat] = {}  # residual vs prior per model
        self._pairs: deque[tuple[float, float]] = deque(maxlen=window)
        self.observed = 0
        # query -> (prior, estimate) of its estimate(), so learn() does not featurize the
        # text again: keyed by id, holding the query so the id cannot be reused meanwhile
        self._recent: OrderedDict[int, tuple[LengthQuery, tuple[float, float, str], LengthEstimate]]
        self._recent = OrderedDict()
        self.recent_capacity = 4096

    # -- pieces
    def _prior(self, q: LengthQuery) -> tuple[float, float, str]:
        """(log mean, log spread, source) before online corrections."""
        if self.text_model is not None and q.text:
            score = self.text_model.score(q.text, q.num_prompt_tokens)
            l50, l90 = self.text_model.log_quantiles(score, q.model)
            return l50, max(0.1, (l90 - l50) / Z90), "text"
        st = self._model_prior.get(q.model)
        if st is not None and st.n > 0:
            return st.mean, max(0.1, math.sqrt(st.var)), "model"
        return math.log1p(self.initial), 1.0, "cold"

    def _keys(self, q: LengthQuery) -> list[object]:
        keys: list[object] = [("h", q.model, h) for h in q.block_hashes]
        if q.session_id:
            keys.append(("s", q.model, q.session_id))
        return keys

    def _memory(self, q: LengthQuery) -> tuple[float, float]:
        """(weighted log mean, total weight) of the deepest remembered prefix levels."""
        total_w = total = 0.0
        levels = 0
        if q.session_id:
            st = self._prefix.get(("s", q.model, q.session_id))
            if st is not None:
                total_w += st.n
                total += st.n * st.mean
        for h in reversed(list(q.block_hashes)):
            st = self._prefix.get(("h", q.model, h))
            if st is None:
                continue
            w = st.n / (1.0 + levels)
            total_w += w
            total += w * st.mean
            levels += 1
            if levels >= self.prefix_levels:
                break
        return (total / total_w if total_w else 0.0), total_w

    # -- interface
    def _log_estimate(
        self, q: LengthQuery, prior: tuple[float, float, str] | None = None
    ) -> tuple[float, float, str]:
        mu, sd, source = prior if prior is not None else self._prior(q)
        drift = self._drift.get(q.model) if source == "text" else None
        if drift is not None:  # shrunk: a few residuals are noise, not a bias
            mu += drift.mean * drift.n / (drift.n + self.drift_prior_n)
            sd = max(0.1, math.sqrt(drift.var)) if drift.n >= 8 else sd
        mem, weight = self._memory(q)
        if weight > 0:
            lam = weight / (weight + self.prefix_strength)
            mu = lam * mem + (1.0 - lam) * mu
            source += "+prefix"
        return mu, sd, source

    def estimate(self, query: LengthQuery) -> LengthEstimate:
        prior = self._prior(query)
        mu, sd, source = self._log_estimate(query, prior)
        est = LengthEstimate(math.expm1(mu), math.expm1(mu + Z90 * sd), source)
        est = est.clamp(query.max_tokens)
        self._recent[id(query)] = (query, prior, est)
        while len(self._recent) > self.recent_capacity:
            self._recent.popitem(last=False)
        return est

    def _recall(self, query: LengthQuery) -> tuple[tuple[float, float, str], LengthEstimate]:
        hit = self._recent.pop(id(query), None)
        if hit is not None and hit[0] is query:
            return hit[1], hit[2]
        est = self.estimate(query)
        return self._recent.pop(id(query))[1], est

    def learn(self, query: LengthQuery, completion_tokens: int) -> None:
        if completion_tokens <= 0:
            return
        y = math.log1p(completion_tokens)
        (prior_mu, _, source), est = self._recall(query)  # what it predicted for this query
        self._pairs.append((est.p50, float(completion_tokens)))
        if source == "text":  # the text model's bias for this served model, tracked
            self._drift.setdefault(query.model, _Stat()).add(y - prior_mu, self.drift_alpha)
        self._model_prior.setdefault(query.model, _Stat()).add(y, self.drift_alpha)
        for key in self._keys(query):
            st = self._prefix.get(key)
            if st is None:
                st = self._prefix[key] = _Stat()
            else:
                self._prefix.move_to_end(key)
            st.add(y, self.prefix_alpha)
        while len(self._prefix) > self.prefix_capacity:
            self._prefix.popitem(last=False)
        self.observed += 1

    # -- introspection
    def running_tau(self) -> float:
        if len(self._pairs) < 2:
            return 0.0
        p, a = zip(*self._pairs, strict=True)
        return kendall_tau(p, a)

    def recent_pairs(self) -> list[tuple[float, float]]:
        return list(self._pairs)
