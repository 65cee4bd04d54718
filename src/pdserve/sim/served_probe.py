"""The served probe: how fast the serving stack answers right now, on an idle cluster.

The contention probe (`sim.probe`) times engine steps alone, between arms. A served request
also pays the stack around them: the router, the gRPC relays and the worker's threads beside
its engine, all on the same shared cores. Six served runs of the same conversation requests
within 90 minutes read colocated TPOT p50 20.5-23.8 ms while the engine probe read the same
machine, so that part moves on its own. This probe sends a fixed set of requests one at a
time (nothing queues) to the arm's own cluster just before and just after its benchmark, and
to each of the profile's clusters: prompts of one length, each a fresh one (the prefix cache
never answers), streamed greedily to a fixed length; the medians of their TTFT and TPOT.
The arm's reading over its profile's is the arm's served factor (`served_factors`).
"""

from __future__ import annotations

import statistics
from typing import Any

PROMPT_LEN = 64
MAX_TOKENS = 32
REPEATS = 5


async def served_probe(
    addr: str, repeats: int = REPEATS, prompt_len: int = PROMPT_LEN, max_tokens: int = MAX_TOKENS
) -> dict[str, Any]:
    """{"ttft_s", "tpot_s"}: the medians over `repeats` requests, after one that warms up."""
    import numpy as np

    from pdserve.client import AsyncClient

    rng = np.random.default_rng()  # fresh prompts at every call: none is in a prefix cache
    ttft: list[float] = []
    tpot: list[float] = []
    async with AsyncClient(addr, timeout=120.0) as client:
        for i in range(repeats + 1):
            r = await client.generate(token_ids=rng.integers(10, 200, prompt_len).tolist(),
                                      max_tokens=max_tokens, ignore_eos=True)  # fmt: skip
            if i:  # the first pays the connection's set-up
                ttft.append(r.ttft_ms / 1e3)
                tpot.append(r.tpot_ms / 1e3)
    return {"ttft_s": statistics.median(ttft), "tpot_s": statistics.median(tpot),
            "repeats": repeats, "prompt_len": prompt_len, "max_tokens": max_tokens}  # fmt: skip


def served_factors(reference: dict[str, Any], before: dict[str, Any], after: dict[str, Any]
                   ) -> dict[str, float]:  # fmt: skip
    """The arm's served TTFT and TPOT over the reference's (the profile's cluster of the same
    shape), the mean of the readings before and after the arm."""
    return {
        f"{k}_factor": (before[f"{k}_s"] + after[f"{k}_s"]) / 2 / reference[f"{k}_s"]
        for k in ("ttft", "tpot")
    }
