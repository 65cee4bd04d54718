"""Simulated `bench serve`: the same workloads (trace readers, arrival processes, seeds, rate
sweeps) replayed on a `SimCluster`; the result has `bench serve`'s JSON shape and plots, so
`bench compare`/`rescore` read simulated runs too.

Cluster flags are a subset of `pdserve up`'s (`--mode`, `--prefill`, `--decode`,
`--colocated`, `--kvstore`, `--kvstore-capacity-bytes`, `--policy`, `--worker-arg=--num-blocks=N`
and the other engine-shape worker flags) and every `--router-arg`: those are parsed into
`RouterSettings` exactly as the router parses its flags (`--router-arg` values are the
router's command line, in order, after `up`'s `--policy`), so the length predictor, the
overload queue, KV headroom, decode placement, session affinity and the flip controller
with its knobs follow the same arm string as in `pdserve up`. A `bench compare` arm string
means the same cluster here.
"""

from __future__ import annotations

import argparse
import json
import shlex
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.bench.serve import sweep_result
from pdserve.config import SettingsError
from pdserve.costmodel.costs import CostModel
from pdserve.kv.window_group import window_pool_sizes
from pdserve.sim.cluster import ClusterSpec, PoolSpec, SimCluster
from pdserve.sim.instance import InstanceConfig
from pdserve.sim.router_side import flip_thresholds, router_settings
from pdserve.workload import arrivals
from pdserve.workload.goodput import (
    SLO,
    attainment,
    vllm_goodput,
)
from pdserve.workload.metrics import summarize
from pdserve.workload.spec import offered_rate, workload_at

# worker defaults (pdserve.worker.settings) the simulated engines copy
WORKER_MAX_BATCHED_TOKENS = 512
WORKER_MAX_SEQS = 64
WORKER_KV_BYTES = 1 << 30


def up_parser() -> argparse.ArgumentParser:
    """The `pdserve up` flags a simulated cluster understands (unknown ones are ignored)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--mode", choices=["disagg", "colocated"], default="disagg")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--colocated", type=int, default=2)
    p.add_argument("--kvstore", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--kvstore-capacity-bytes", type=int, default=1 << 30)
    p.add_argument("--policy")
    p.add_argument("--worker-arg", action="append", default=[])
    p.add_argument("--router-arg", action="append", default=[])
    p.add_argument("--model")
    return p


def worker_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--num-blocks", type=int)
    p.add_argument("--kv-cache-bytes", type=int)
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-num-batched-tokens", type=int, default=WORKER_MAX_BATCHED_TOKENS)
    p.add_argument("--max-num-seqs", type=int, default=WORKER_MAX_SEQS)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window-pool", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--window-blocks", type=int)
    return p


def default_num_blocks(
    kv_bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_bytes: int | None,
) -> int:
    """`LLMEngine._num_blocks` with the worker's defaults."""
    per_block = max(1, kv_bytes_per_token * block_size)
    per_seq = -(-max_model_len // block_size)
    if kv_bytes is not None:
        return max(1, kv_bytes // per_block)
    budget = WORKER_KV_BYTES // per_block
    return max(per_seq + 1, min(budget, per_seq * max_num_seqs))


def instance_kv_config(
    costs: CostModel,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    kv_bytes: int | None,
    *,
    max_num_batched_tokens: int,
    chunked_prefill: bool,
    num_blocks: int | None = None,
    window_pool: bool = True,
    window_blocks: int | None = None,
) -> dict[str, Any]:
    """The KV pools of an instance as the engine sizes them (`LLMEngine._num_blocks`):
    `num_blocks`, and for a layered model with a sliding group (`costs.kv_window`) its
    `window` and `window_blocks` (kv.window_group.window_pool_sizes). InstanceConfig
    keyword arguments."""
    one_pool = num_blocks or default_num_blocks(
        costs.kv_bytes_per_token, block_size, max_model_len, max_num_seqs, kv_bytes
    )
    if not (window_pool and costs.kv_window):
        return {"num_blocks": one_pool}
    win_b = costs.kv_window_bytes_per_token * block_size
    full_b = costs.kv_bytes_per_token * block_size - win_b
    step = max_num_batched_tokens if chunked_prefill else max(max_num_batched_tokens, max_model_len)
    n, n_w = window_pool_sizes(
        (full_b, win_b),
        block_size,
        costs.kv_window,
        step_tokens=step,
        max_num_seqs=max_num_seqs,
        kv_cache_bytes=kv_bytes,
        num_blocks=num_blocks,
        window_blocks=window_blocks,
        default_blocks=one_pool,
        max_model_len=max_model_len,
    )
    return {"num_blocks": n, "window": costs.kv_window, "window_blocks": n_w}


def load_profile(path: str | Path) -> dict[str, Any]:
    data = json.loads(Path(path).read_text())
    if "costs" not in data:
        raise ValueError(f"{path}: not a pdserve profile (no 'costs')")
    return data


ROLES = ("prefill", "decode", "colocated")


def costs_of_profile(prof: dict[str, Any]) -> CostModel | dict[str, CostModel]:
    """A profile's costs: one CostModel, or one per role when the profile measured a role's
    own terms (`roles`: role -> CostModel fields that differ, e.g. the prefill and decode
    of a served 1P1D slowing each other: `neighbour_busy_factor`)."""
    base = CostModel.from_json(prof["costs"])
    roles = prof.get("roles") or {}
    if not roles:
        return base
    return {r: CostModel.from_json(prof["costs"] | (roles.get(r) or {})) for r in ROLES}


def spec_from_up_flags(
    flags: list[str],
    costs: CostModel | Mapping[str, CostModel | list[CostModel]],
    max_model_len: int,
    block_size: int = 16,
) -> ClusterSpec:
    """A ClusterSpec from `pdserve up` flags. `costs` may differ per role (heterogeneous),
    and within a role per worker (a list, dealt in order: `roofline.pool_costs`)."""
    up, _ = up_parser().parse_known_args(flags)
    wk, _ = worker_parser().parse_known_args([a for f in up.worker_arg for a in shlex.split(f)])
    router_argv = (["--policy", up.policy] if up.policy else []) + [
        a for f in up.router_arg for a in shlex.split(f)
    ]
    try:
        rt = router_settings(router_argv)
    except SettingsError as exc:
        raise ValueError(f"router flags {router_argv}: {exc}") from None

    def costs_of(role: str) -> list[CostModel]:
        """One per hardware type the pool's workers are dealt, in order (they cycle)."""
        c = costs[role] if isinstance(costs, dict) else costs
        return list(c) if isinstance(c, list) else [c]

    def config_for(c: CostModel) -> InstanceConfig:
        bs = wk.block_size or block_size
        kv_bytes = wk.kv_cache_bytes or c.kv_capacity_bytes
        pools = instance_kv_config(
            c,
            bs,
            max_model_len,
            wk.max_num_seqs,
            kv_bytes,
            max_num_batched_tokens=wk.max_num_batched_tokens,
            chunked_prefill=wk.chunked_prefill,
            num_blocks=wk.num_blocks,
            window_pool=wk.window_pool,
            window_blocks=wk.window_blocks,
        )
        return InstanceConfig(
            **pools,
            block_size=bs,
            max_num_batched_tokens=wk.max_num_batched_tokens,
            max_num_seqs=wk.max_num_seqs,
            chunked_prefill=wk.chunked_prefill,
            enable_prefix_caching=wk.enable_prefix_caching,
            max_model_len=max_model_len,
        )

    def pool(role: str, count: int) -> list[PoolSpec]:
        cs = costs_of(role)
        if len(cs) == 1:
            return [PoolSpec(role, count, cs[0], config_for(cs[0]))]
        # mixed hardware: one spec per worker, in the order `pdserve up` deals them
        return [PoolSpec(role, 1, c, config_for(c)) for c in (cs * count)[:count]]

    if up.mode == "colocated":
        pools = pool("colocated", up.colocated)
    else:
        pools = pool("prefill", up.prefill) + pool("decode", up.decode)
    return ClusterSpec(
        pools=pools,
        policy=rt.placement.policy,
        session_affinity=rt.placement.session_affinity,
        kvstore_capacity_bytes=up.kvstore_capacity_bytes if up.kvstore and rt.use_kvstore else None,
        kv_queue_timeout_s=rt.admission.kv_queue_timeout_s,
        heartbeat_interval_s=rt.heartbeat_interval_s,
        router=rt,
        flip=flip_thresholds(rt) if rt.flip.flip_enabled else None,
        flip_interval_s=rt.flip.flip_interval_s,
    )


class LazyTrace:
    """A trace's requests before arrivals, prompts drawn on demand in trace order. Request
    i's prompt is the one `base_requests` draws (one generator, drawn in order), so the first
    n requests are the same however many are drawn; replaying a 30 s window of an hour-long
    trace draws only the window's prompts."""

    def __init__(self, args: argparse.Namespace, salt: int) -> None:
        from pdserve.workload.requests import iter_trace_requests
        from pdserve.workload.spec import model_limits, prompt_seed, trace_window

        vocab, max_len = model_limits(args)
        records = trace_window(args)
        self.stamps = [r.timestamp_s for r in records]
        self._gen = iter_trace_requests(
            records, vocab, prompt_seed(args, salt), args.length_scale, max_len, args.block_size
        )
        self._reqs: list[Any] = []

    def first(self, n: int) -> list[Any]:
        while len(self._reqs) < n:
            self._reqs.append(next(self._gen))
        return self._reqs[:n]

    def all(self) -> list[Any]:
        return self.first(len(self.stamps))


_BASE_CACHE: dict[tuple[int, int], LazyTrace] = {}


def base_for(args: argparse.Namespace, salt: int) -> LazyTrace | None:
    """A trace's requests before arrivals, read once per (args, salt): a sweep or a plan
    replays one trace at many rates. None: not a trace workload."""
    if not args.trace or getattr(args, "lengths", None):
        return None
    key = (id(args), salt)
    if key not in _BASE_CACHE:
        _BASE_CACHE.clear()
        _BASE_CACHE[key] = LazyTrace(args, salt)
    return _BASE_CACHE[key]


def sim_workload(args: argparse.Namespace, rate: float | None, salt: int = 0) -> list[Any]:
    """`bench.serve.workload_at` for the simulator: a duration-bounded trace window draws
    only its own prompts (`arrivals.replay_window`, as `workload_at` replays it)."""
    base = base_for(args, salt)
    if base is None:
        return workload_at(args, rate, salt)
    if rate is None or not args.duration:
        return workload_at(args, rate, salt, base=base.all())
    n, times = arrivals.replay_window(base.stamps, rate, args.duration)
    out = [replace(r, arrival_s=t) for r, t in zip(base.first(n), times, strict=True)]
    return [r for r in out if r.arrival_s < args.duration]


CHARS_PER_TOKEN = 4.0  # a text prompt's length in tokens, as cl100k-style BPEs average on English


def text_prompt_ids(reqs: list[Any], vocab: int) -> list[Any]:
    """Requests sent as text (the `--lengths` workload) get token ids to simulate with: a
    deterministic pseudo-random run (seeded by the text) of len(text) / 4 tokens. The text
    stays on the request: the length predictor reads it as the router does."""
    import zlib

    import numpy as np

    from pdserve.workload.requests import TOKEN_LO

    for r in reqs:
        if r.prompt_ids or not r.prompt_text:
            continue
        n = max(1, round(len(r.prompt_text.encode()) / CHARS_PER_TOKEN))
        rng = np.random.default_rng(zlib.crc32(r.prompt_text.encode()))
        r.prompt_ids = rng.integers(TOKEN_LO, max(TOKEN_LO + 1, vocab), n).tolist()
    return reqs


def allowed_misses(n: int, target: float) -> int:
    """The most of `n` requests that may miss while the attainment, computed as
    `workload.goodput.attainment` computes it ((n - misses) / n), still reaches `target`: one
    more miss decides that the run fails. (`int((1 - target) * n)` is one short when
    1 - target rounds down, e.g. 0.1 * 540 -> 53: a run with 54 misses, attainment exactly
    0.9, was stopped as a failure.)"""
    m = max(0, int((1.0 - target) * n))
    while m < n and (n - (m + 1)) / n >= target:
        m += 1
    while m > 0 and (n - m) / n < target:
        m -= 1
    return m


def simulate_once(
    spec: ClusterSpec,
    args: argparse.Namespace,
    rate: float | None,
    slo: SLO,
    salt: int = 0,
    early_stop_target: float | None = None,
    keep_records: bool = True,
) -> dict[str, Any]:
    """`bench.serve.run_once` in simulated time. `early_stop_target`: stop once the run
    cannot reach that TTFT+TPOT attainment (its attainment is then a lower bound)."""
    reqs = sim_workload(args, rate, salt)
    text_prompt_ids(reqs, args.vocab_size or 32000)
    cluster = SimCluster(spec)
    ts = slo.only("ttft", "tpot")
    if early_stop_target is not None and ts.ttft_ms is not None and ts.tpot_ms is not None:
        cluster.stop_early(ts.ttft_ms / 1e3, ts.tpot_ms / 1e3,
                           allowed_misses(len(reqs), early_stop_target),
                           limits_ms=(ts.ttft_ms, ts.tpot_ms))  # fmt: skip
    records = cluster.run(reqs)
    ends = [r.finish_s for r in records if r.finish_s is not None]
    wall = max(ends) if ends else 0.0
    summary = summarize(records, wall)
    return {
        "rate": rate if rate is not None else arrivals.mean_rate([r.arrival_s for r in reqs]),
        "offered": offered_rate(reqs, args),
        "records": [r.to_json() for r in records] if keep_records else [],
        "summary": summary,
        "vllm_goodput_req_s": vllm_goodput(records, slo, wall) if not slo.is_empty() else None,
        "attainment_ttft_tpot": attainment(records, ts) if not ts.is_empty() else None,
        "sim": {
            "events": cluster.loop.events,
            "utilisation": cluster.utilisation(wall),
            "engine_s": cluster.engine_seconds() if spec.track_engine else None,
            "flips": cluster.flips,
            "preemptions": sum(i.scheduler.num_preemptions for i in cluster.instances.values()),
            "stopped_early": cluster.stop_after_misses is not None
            and cluster.misses > cluster.stop_after_misses,
        },
        "_records": records,
    }


def simulate_benchmark(spec: ClusterSpec, args: argparse.Namespace) -> dict[str, Any]:
    """`bench.serve.run_benchmark` in simulated time (same sweep logic and result shape)."""
    slo = SLO.parse(args.goodput)
    return sweep_result(
        args,
        slo,
        lambda rate, salt: simulate_once(spec, args, rate, slo, salt=salt),
        {"simulated": True, "cluster": spec.describe()},
    )
