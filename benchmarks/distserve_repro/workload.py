"""The ShareGPT-like request list both simulators serve: lengths from a stated distribution
with DistServe's ShareGPT statistics, Poisson arrivals, one seed; no dataset download.

Lengths: input ~ log-normal(mu_in, sigma_in), output ~ log-normal(mu_out, sigma_out), rounded,
at least 1 token; a pair whose input + output reaches 2,048 tokens (OPT's context) is dropped
and redrawn, as DistServe's dataset preparation drops them. mu_in and mu_out are solved so that
the kept pairs' means are DistServe's (755.5 input, 200.3 output tokens) on a 200,000-pair pool.
The spreads are assumptions, not DistServe's data: sigma_in = 0.5 and sigma_out = 0.8 (the ones
docs/studies/disagg-vs-colocated.md used), and 1.0 / 1.0 (a longer tail) to show what they move.
Arrivals: unit-rate exponential gaps (the same seed) divided by the rate, so every rate replays
the same requests in the same order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

MEAN_IN, MEAN_OUT = 755.5, 200.3
SIGMAS = (0.5, 0.8)  # (input, output) log-normal spreads
MAX_PAIR = 2048  # pairs with input + output >= this are dropped


@dataclass(frozen=True)
class Workload:
    pairs: list[tuple[int, int]]  # (input tokens, output tokens)
    gaps: list[float]  # unit-rate inter-arrival gaps (s x rate)
    seed: int
    sigmas: tuple[float, float] = SIGMAS

    def arrivals(self, rate: float) -> list[float]:
        """Arrival offsets (s) at `rate` req/s; the first request at 0."""
        t = np.concatenate([[0.0], np.cumsum(self.gaps[1:])]) / rate
        return t.tolist()

    def describe(self) -> dict[str, float]:
        a = np.array(self.pairs, float)
        return {"n": len(self.pairs), "seed": self.seed, "sigma_in": self.sigmas[0],
                "sigma_out": self.sigmas[1], "mean_in": round(float(a[:, 0].mean()), 1),
                "mean_out": round(float(a[:, 1].mean()), 1), "p50_in": float(np.median(a[:, 0])),
                "p90_in": float(np.percentile(a[:, 0], 90)), "p50_out": float(np.median(a[:, 1])),
                "p90_out": float(np.percentile(a[:, 1], 90))}  # fmt: skip


def _draw(
    rng: np.random.Generator, n: int, mu: tuple[float, float], sigmas: tuple[float, float]
) -> np.ndarray:
    """n kept pairs (dropped pairs redrawn)."""
    out = np.empty((0, 2))
    while len(out) < n:
        k = 2 * (n - len(out)) + 16
        x = np.maximum(1, np.rint(rng.lognormal(mu[0], sigmas[0], k)))
        y = np.maximum(1, np.rint(rng.lognormal(mu[1], sigmas[1], k)))
        keep = (x + y) < MAX_PAIR
        out = np.vstack([out, np.stack([x[keep], y[keep]], axis=1)])
    return out[:n]


@lru_cache(maxsize=8)
def solve_mu(
    sigmas: tuple[float, float] = SIGMAS, pool: int = 200_000, seed: int = 12345
) -> tuple[float, float]:
    """(mu_in, mu_out) whose kept pairs have DistServe's means (fixed-point on the pool)."""
    mu = [np.log(MEAN_IN) - sigmas[0] ** 2 / 2, np.log(MEAN_OUT) - sigmas[1] ** 2 / 2]
    for _ in range(30):
        a = _draw(np.random.default_rng(seed), pool, (mu[0], mu[1]), sigmas)
        mu[0] += np.log(MEAN_IN / a[:, 0].mean())
        mu[1] += np.log(MEAN_OUT / a[:, 1].mean())
    return float(mu[0]), float(mu[1])


def sharegpt_like(n: int = 1000, seed: int = 0, sigmas: tuple[float, float] = SIGMAS) -> Workload:
    mu = solve_mu(sigmas)
    rng = np.random.default_rng(seed)
    pairs = [(int(x), int(y)) for x, y in _draw(rng, n, mu, sigmas)]
    gaps = np.concatenate([[0.0], rng.exponential(1.0, n - 1)]).tolist()
    return Workload(pairs, gaps, seed, sigmas)


def write_distserve_workload(w: Workload, rate: float, path: Path) -> None:
    """DistServe's custom workload file (simulate_dist --workload FILE --arrival custom):
    a list of {start_time (s), prompt_len, output_len}. Its simulator runs output_len decode
    steps after the prefill; ours serves output_len + 1 tokens (token 0 from the prefill)."""
    rows = [{"start_time": t, "prompt_len": i, "output_len": o}
            for t, (i, o) in zip(w.arrivals(rate), w.pairs, strict=True)]  # fmt: skip
    path.write_text(json.dumps(rows))
