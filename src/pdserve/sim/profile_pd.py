"""`pdserve profile`, the served 1P1D part: how much a busy neighbour slows each role.

On a CPU host the prefill and the decode of a disaggregated cluster share the machine: two
engine threads on its cores, their memory bandwidth, and the serving work (the router's
relays, each worker's gRPC and UCX sends and receives) that no longer has a spare core when
both engines step. The engine-only profile and a contention probe taken between runs see
none of it. This part measures it on a real 1P1D cluster (router + prefill + decode, mutual
TLS), in alternating phases so that a change of the machine's load hits both sides:

- prefill: prompts sent one at a time (nothing queues), the worker's prefill stage over the
  engine-only time of the same chunks (the fitted step model), with the decode idle and
  with the decode busy (long greedy streams running): factor = busy / idle;
- with the decode idle, what a disaggregated prompt costs beyond its engine steps: its
  prefill stage minus the prefill worker's own steps of a prompt of the same length that
  pushes nothing, sent just before it (its step counters, `served_steps`: handing each
  layer's KV to the push, sending token 0), fitted as a + b * tokens (`prefill_chunk_s`,
  `prefill_token_s` of the prefill role; without counters, against a colocated worker's
  served prefill stage of the same length), and the
  request path outside the stages (client TTFT minus the prefill and transfer stages: the
  router's Reserve on the decode, then its Prefill call, and the token's way back;
  `router_overhead_s` of both roles, where a colocated request makes one call);
- decode: B concurrent streams' TPOT with the prefill idle and with the prefill busy
  (prompts sent back to back): factor = busy / idle;
- a cold prompt step: a prompt's own steps after a pause in which the decode stepped a
  stream, less the same length's sent right after another prompt (`cold_prompt_s`, the
  median over lengths and rounds). At a trace's arrival rate most prompts find the prefill
  idle; back to back, as the rest of the profile and the engine probe step, the weights and
  buffers the last step touched are still in the caches.
Each round runs both sides of both roles (idle first in even rounds, busy first in odd ones);
a role's factor is the median over rounds of that round's busy / idle medians.

The simulator multiplies a role's step by its factor while another instance is stepping
(`CostModel.neighbour_busy_factor`); factors below 1 (noise) are kept at 1.
"""

from __future__ import annotations

import asyncio
import statistics
from typing import Any

import numpy as np

from pdserve.costmodel.costs import StepCost
from pdserve.sim.served_probe import served_probe
from pdserve.sim.served_steps import (
    mean_decode_step_s,
    read_step_counters_async,
    serving_work_per_step,
)


def engine_prefill_s(step: StepCost, n: int, budget: int) -> float:
    """Engine-only seconds of an n-token prompt run alone: its chunks of `budget` tokens."""
    return sum(step.step_s([(s, min(budget, n - s))]) for s in range(0, n, budget))


def profile_pd(
    model_dir: str,
    dtype: str,
    threads: int,
    step: StepCost,
    device: str = "cpu",
    prompt_lens: tuple[int, ...] = (32, 128, 256, 512, 1024),
    streams: int = 4,
    stream_tokens: int = 48,
    rounds: int = 3,
    budget: int = 512,
    max_model_len: int | None = None,
    colocated_prompts: list[dict[str, float]] | None = None,
    colocated_extra: tuple[float, float] = (0.0, 0.0),
    idle_streams: tuple[int, ...] = (1, 2, 4, 8, 16),
    neighbour_streams: tuple[int, ...] = (1, 4),
    cold_lens: tuple[int, ...] = (64, 160, 300),
    cold_stream_tokens: int = 40,
    cold_pause_s: float = 0.3,
) -> dict[str, Any]:
    """`colocated_prompts`: `profile_serving`'s served prompts ({"tokens", "prefill_s"}), the
    reference of the disaggregated prompt's extra, which adds to `colocated_extra` (the
    colocated worker's own (prefill_chunk_s, prefill_token_s)); without them the reference
    is the engine-only step."""
    from pdserve.client import AsyncClient
    from pdserve.launcher import Cluster, ClusterConfig

    if max_model_len:
        prompt_lens = tuple(min(n, max_model_len - 2) for n in prompt_lens)
        cold_lens = tuple(min(n, max_model_len - 2) for n in cold_lens)
    cluster = Cluster(ClusterConfig(
        model=model_dir, mode="disagg", prefill=1, decode=1, port=0,
        worker_args=["--threads", str(threads), "--dtype", dtype, "--device", device],
    ))  # fmt: skip
    rng = np.random.default_rng(2)
    cluster.start(timeout=300.0)

    def ids(n: int) -> list[int]:
        return rng.integers(10, 200, n).tolist()

    paths: list[dict[str, float]] = []  # the idle prompts' stages (the decode idle)

    async def prompts(client: Any, idle: bool = False) -> list[float]:
        """Each prompt's prefill stage / its engine-only time, one at a time."""
        out = []
        for n in prompt_lens:
            alone = await prompt_alone_s(client, n) if idle else None
            r = await client.generate(token_ids=ids(n), max_tokens=2, ignore_eos=True)
            stages = r.usage.stages if r.usage else {}
            served = stages.get("prefill_ms", 0.0) / 1e3
            engine_s = engine_prefill_s(step, n, budget)
            out.append(served / engine_s)
            if idle:
                paths.append({
                    "tokens": n, "prefill_s": served, "engine_step_s": engine_s,
                    "served_step_s": alone,
                    "ttft_s": r.ttft_ms / 1e3, "transfer_s": stages.get("transfer_ms", 0.0) / 1e3,
                    "reserve_s": stages.get("reserve_ms", 0.0) / 1e3,
                })  # fmt: skip
        return out

    async def prompt_alone_s(client: Any, n: int) -> float | None:
        """The prefill worker's own steps of an n-token prompt that pushes nothing (one token:
        the router's prefill-only path), just before the 2-token one: the engine's cost of
        that prompt now, without the hand-off of its KV to the push, which happens inside
        the steps of a prompt that pushes."""
        before = await read_step_counters_async(cluster, "prefill0")
        await client.generate(token_ids=ids(n), max_tokens=1, ignore_eos=True)
        after = await read_step_counters_async(cluster, "prefill0")
        return after.since(before).seconds if before and after else None

    async def tpots(client: Any, b: int = streams) -> list[float]:
        rs = await asyncio.gather(*(
            client.generate(token_ids=ids(64), max_tokens=stream_tokens, ignore_eos=True)
            for _ in range(b)
        ))  # fmt: skip
        return [r.tpot_ms / 1e3 for r in rs]

    async def idle_points(client: Any) -> list[dict[str, Any]]:
        """Per stream count: the median TPOT, the engine-only step of that batch and the
        decode's own mean step over the same window (it steps decodes only)."""
        out = []
        for b in idle_streams:
            before = await read_step_counters_async(cluster, "decode0")
            tpot = statistics.median(await tpots(client, b))
            after = await read_step_counters_async(cluster, "decode0")
            window = after.since(before) if before and after else None
            out.append({"streams": b, "tpot_s": tpot,
                        "engine_step_s": step.step_s([(64 + stream_tokens // 2, 1)] * b),
                        "served_step_s": mean_decode_step_s(window, 0, 0.0)})  # fmt: skip
        return out

    async def prefill_phase(client: Any, busy: bool, beside: int = streams) -> list[float]:
        if not busy:
            return await prompts(client, idle=True)
        long = 8 * stream_tokens  # outlasts the prompts; cancelled when they are done
        bg = [asyncio.ensure_future(client.generate(token_ids=ids(64), max_tokens=long,
                                                    ignore_eos=True)) for _ in range(beside)]  # fmt: skip
        await asyncio.sleep(0.5)  # the streams are decoding
        try:
            return await prompts(client)
        finally:
            for t in bg:
                t.cancel()
            await asyncio.gather(*bg, return_exceptions=True)

    async def decode_phase(client: Any, busy: bool) -> list[float]:
        if not busy:
            return await tpots(client)
        stop = asyncio.Event()

        async def flood() -> None:
            while not stop.is_set():
                await client.generate(token_ids=ids(max(prompt_lens)), max_tokens=2,
                                      ignore_eos=True)  # fmt: skip

        bg = asyncio.ensure_future(flood())
        await asyncio.sleep(0.2)  # the first prompt is computing
        try:
            return await tpots(client)
        finally:
            stop.set()
            await asyncio.gather(bg, return_exceptions=True)

    async def own_steps_s(client: Any, n: int) -> float | None:
        """The prefill worker's own step seconds of one pushing n-token prompt."""
        before = await read_step_counters_async(cluster, "prefill0")
        await client.generate(token_ids=ids(n), max_tokens=2, ignore_eos=True)
        after = await read_step_counters_async(cluster, "prefill0")
        return after.since(before).seconds if before and after else None

    async def cold_pairs(client: Any) -> list[float]:
        """Per prompt length: the prompt's own steps after a pause in which the decode
        stepped a stream (as between a trace's arrivals) less the same length's right after
        another prompt: what a cold start of the prompt step costs."""
        out = []
        for n in cold_lens:
            await client.generate(token_ids=ids(n), max_tokens=2, ignore_eos=True)
            warm = await own_steps_s(client, n)
            await client.generate(token_ids=ids(64), max_tokens=cold_stream_tokens,
                                  ignore_eos=True)  # fmt: skip
            await asyncio.sleep(cold_pause_s)
            cold = await own_steps_s(client, n)
            if warm is not None and cold is not None:
                out.append(cold - warm)
        return out

    async def run() -> list[dict[str, list[float]]]:
        rounds_out = []
        async with AsyncClient(cluster.addr, timeout=300.0) as client:
            await client.generate(token_ids=ids(32), max_tokens=4, ignore_eos=True)  # warm-up
            for k in range(rounds):  # idle, busy / busy, idle: a drift hits both sides
                got: dict[str, list[float]] = {}
                order = (False, True) if k % 2 == 0 else (True, False)
                for busy in order:
                    got["p_busy" if busy else "p_idle"] = await prefill_phase(client, busy)
                for b in (n for n in neighbour_streams if n != streams):  # the factor by batch
                    got[f"p_busy_{b}"] = await prefill_phase(client, True, beside=b)
                for busy in order:
                    got["d_busy" if busy else "d_idle"] = await decode_phase(client, busy)
                got["d_idle_points"] = await idle_points(client)  # type: ignore[assignment]
                got["cold"] = await cold_pairs(client)
                rounds_out.append(got)
        return rounds_out

    try:
        got = asyncio.run(run())
        reference = asyncio.run(served_probe(cluster.addr))  # `sim validate --probe`'s base
    finally:
        cluster.stop()
    # per round, busy over idle (medians of that round); the factor: the median over rounds
    med = statistics.median
    per_round = [{"prefill": med(g["p_busy"]) / med(g["p_idle"]),
                  "decode": med(g["d_busy"]) / med(g["d_idle"])} for g in got]  # fmt: skip
    raw = {k: med(r[k] for r in per_round) for k in ("prefill", "decode")}
    by_batch = {b: med(med(g[f"p_busy_{b}"]) / med(g["p_idle"]) for g in got)
                for b in neighbour_streams if b != streams} | {streams: raw["prefill"]}  # fmt: skip
    cold = [c for g in got for c in g.get("cold") or []]
    chunk_s, token_s = disaggregated_prompt_extra(paths, budget, colocated_prompts, colocated_extra)
    path_s = med(p["ttft_s"] - p["prefill_s"] - p["transfer_s"] for p in paths) if paths else 0.0
    reserve_s = med(p.get("reserve_s", 0.0) for p in paths) if paths else 0.0
    return {
        "prefill_factor": max(1.0, raw["prefill"]),
        "decode_factor": max(1.0, raw["decode"]),
        # the prefill's factor by the decode's running streams, never below 1 nor falling
        "prefill_factor_points": monotone_points(by_batch, floor=1.0),
        # a prompt step after a pause costs this more than one back to back (median, >= 0)
        "cold_prompt_s": max(0.0, med(cold)) if cold else 0.0,
        "cold_samples": cold,
        "decode_stream_points": decode_stream_points(got),
        "reserve_s": max(0.0, min(reserve_s, path_s)),
        "prefill_chunk_s": chunk_s,
        "prefill_token_s": token_s,
        "path_overhead_s": max(0.0, path_s),
        "idle_prompts": paths,
        "served_probe": reference,
        "raw_factors": raw,
        "per_round": per_round,
        "samples": got,  # per round: prefill served / engine-only, decode TPOT seconds
    }


def fit_served_prefill(samples: list[dict[str, Any]]) -> tuple[float, float]:
    """(a, b) >= 0 with a served prompt's prefill stage minus its step ~ a + b * tokens,
    least squares over the per-length medians (a stray slow sample moves a median less than a
    mean). The step: the worker's own (`served_step_s`, its step counters over the prompt),
    else the engine-only fit, whose difference also holds the machine's drift since the fit
    (one code-like profile: 113 us per token, where its own steps read ~0)."""
    by_len: dict[int, list[float]] = {}
    for p in samples:
        step_s = p.get("served_step_s") or p["engine_step_s"]
        by_len.setdefault(int(p["tokens"]), []).append(p["prefill_s"] - step_s)
    n = np.array(sorted(by_len), dtype=float)
    extra = np.array([float(np.median(by_len[int(k)])) for k in n])
    if len(n) < 2:
        return max(0.0, float(extra.mean()) if len(extra) else 0.0), 0.0
    (b, a) = np.polyfit(n, extra, 1)
    if b < 0:  # flat or falling: a constant per chunk
        return max(0.0, float(extra.mean())), 0.0
    if a < 0:  # through 0: a per-token cost only
        return 0.0, max(0.0, float(n @ extra / (n @ n)))
    return float(a), float(b)


def disaggregated_prompt_extra(
    paths: list[dict[str, float]],
    budget: int,
    colocated_prompts: list[dict[str, float]] | None,
    colocated_extra: tuple[float, float],
) -> tuple[float, float]:
    """(prefill_chunk_s, prefill_token_s) of the prefill role from the idle 1P1D prompts of
    one chunk: with the prefill worker's own steps of a same-length prompt that pushes
    nothing (`served_step_s`), the stage beyond them, fitted a + b * n; else against the
    colocated served prompts of the same length, added to the colocated extra; without
    those, against the engine-only step."""
    single = [p for p in paths if p["tokens"] <= budget]  # one chunk: a + b * n per chunk
    if single and all(p.get("served_step_s") for p in single):
        return fit_served_prefill(single)  # against its own steps: no reference needed
    if colocated_prompts is None:
        return fit_served_prefill(single) if single else (0.0, 0.0)
    by_len: dict[int, list[float]] = {}
    for c in colocated_prompts:
        by_len.setdefault(int(c["tokens"]), []).append(float(c["prefill_s"]))
    ref = {n: float(np.median(v)) for n, v in by_len.items()}
    pts = [p | {"engine_step_s": ref[int(p["tokens"])]} for p in single if int(p["tokens"]) in ref]
    a, b = fit_served_prefill(pts) if pts else (0.0, 0.0)
    return colocated_extra[0] + a, colocated_extra[1] + b


def monotone_points(values: dict[int, float], floor: float = 0.0) -> list[tuple[float, float]]:
    """((x, y), ...) ascending in x, never below `floor` nor falling: the least-squares
    non-decreasing fit of the measured ys (pool adjacent violators), so a noisy high point is
    averaged with the lower ones after it rather than lifting them all."""
    xs = sorted(values)
    blocks: list[list[float]] = []  # [sum, count] per pooled run
    for x in xs:
        blocks.append([max(values[x], floor), 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    ys = [b[0] / b[1] for b in blocks for _ in range(int(b[1]))]
    return [(float(x), float(y)) for x, y in zip(xs, ys, strict=True)]


def decode_stream_points(got: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """The served 1P1D decode's serving work per step at each idle stream count
    (`serving_work_per_step` of each round), the median over rounds: the decode role's
    `stream_points`. The prefill's core is idle meanwhile, so it differs from the colocated
    worker's."""
    by_b: dict[int, list[float]] = {}
    for g in got:
        for b, work in serving_work_per_step(g.get("d_idle_points") or []).items():
            by_b.setdefault(b, []).append(work)
    return monotone_points({b: statistics.median(v) for b, v in by_b.items()})


def roles_of(pd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The profile's per-role overrides (`sim.run.costs_of_profile`) from `profile_pd`."""
    path = {"router_overhead_s": float(pd["path_overhead_s"])} if "path_overhead_s" in pd else {}
    extra = {k: float(pd[k]) for k in ("prefill_chunk_s", "prefill_token_s", "cold_prompt_s")
             if k in pd}  # fmt: skip
    prefill: dict[str, Any] = {"neighbour_busy_factor": float(pd["prefill_factor"])}
    if pd.get("prefill_factor_points"):
        prefill["neighbour_points"] = [list(p) for p in pd["prefill_factor_points"]]
    decode: dict[str, Any] = {"neighbour_busy_factor": float(pd["decode_factor"])}
    if pd.get("decode_stream_points"):
        decode["stream_points"] = [list(p) for p in pd["decode_stream_points"]]
    if "reserve_s" in pd:
        decode["reserve_s"] = float(pd["reserve_s"])
    return {"prefill": prefill | extra | path, "decode": decode | path}
