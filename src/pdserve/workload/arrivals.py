"""Arrival processes for an open-loop load: Poisson, gamma (bursty) and trace replay.

All return arrival offsets in seconds from the start of the run, sorted, first >= 0.
Gamma inter-arrivals follow vLLM's benchmark: shape = burstiness, scale = 1 / (rate * shape),
so the mean rate is `rate` for any burstiness; burstiness 1 is Poisson, < 1 burstier,
> 1 more regular.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def gamma_arrivals(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """`n` arrival times with mean rate `rate` req/s; the first request arrives at 0."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if n <= 0:
        return []
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def poisson_arrivals(n: int, rate: float, seed: int = 0) -> list[float]:
    return gamma_arrivals(n, rate, 1.0, seed)


def arrivals_for_duration(
    duration_s: float, rate: float, burstiness: float = 1.0, seed: int = 0
) -> list[float]:
    """Every arrival of the process that falls inside [0, duration_s)."""
    # draw in growing batches so the result is a prefix of one seeded sequence
    n = max(16, int(duration_s * rate * 1.5) + 16)
    while True:
        times = gamma_arrivals(n, rate, burstiness, seed)
        if times[-1] >= duration_s:
            return [t for t in times if t < duration_s]
        n *= 2


def replay_arrivals(
    timestamps: Sequence[float], time_scale: float = 1.0, rate: float | None = None
) -> list[float]:
    """Trace timestamps shifted to start at 0. `time_scale` stretches time (2.0 = half the
    rate); `rate`, if given, overrides it so the replay's mean rate equals `rate`."""
    if not timestamps:
        return []
    t0 = min(timestamps)
    rel = [t - t0 for t in timestamps]
    if rate is not None:
        span = max(rel)
        if rate <= 0:
            raise ValueError(f"rate must be > 0, got {rate}")
        # n requests over `span` -> mean rate (n - 1) / span; rescale to `rate`
        time_scale = ((len(rel) - 1) / span / rate) if span > 0 and len(rel) > 1 else 1.0
    if time_scale <= 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    return [t * time_scale for t in rel]


def replay_window(
    timestamps: Sequence[float], rate: float, duration_s: float
) -> tuple[int, list[float]]:
    """The replayed window of a trace at `rate` req/s for `duration_s` seconds.

    The trace's first n = max(2, round(rate * duration_s)) requests (in time order) are the
    window; they are rescaled so that *their* mean rate, (n - 1) / span, equals `rate`, so the
    last one arrives at (n - 1) / rate < duration_s. Rescaling the whole file to the mean rate
    and then cutting it (the old behaviour) offered a bursty trace's opening window at several
    times the labelled rate. Returns (n, arrival offsets of those n requests).
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    if duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {duration_s}")
    n = min(len(timestamps), max(2, int(rate * duration_s + 0.5)))
    if n == 0:
        return 0, []
    window = list(timestamps[:n])
    if n < 2 or max(window) == min(window):
        # one request, or all at the same instant: spread them evenly at `rate`
        return n, [i / rate for i in range(n)]
    return n, replay_arrivals(window, rate=rate)


def mean_rate(times: Sequence[float]) -> float:
    """Empirical rate of a sorted arrival sequence: (n - 1) / span."""
    if len(times) < 2 or times[-1] == times[0]:
        return 0.0
    return (len(times) - 1) / (times[-1] - times[0])
