"""The simulator keeps a layered model's sliding layers in a window pool, as the engine does.

Against a real engine over the tiny Gemma 4 (fp32): the model shape's split of KV bytes per
token, the pool sizes `instance_kv_config` derives from a byte budget, and the bytes a prefill
pushes all equal the engine's own. In the loop: simulated requests free window blocks as they
decode (both pools full again after a run), land only their window when disaggregated, and at
a fixed KV budget the window pool holds a larger decode batch than one pool for every layer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.costmodel.costs import CostModel, StepCost
from pdserve.costmodel.roofline import roofline_costs
from pdserve.costmodel.shapes import ModelShape, load_model_config
from pdserve.sim.cluster import ClusterSpec, PoolSpec, SimCluster
from pdserve.sim.instance import InstanceConfig
from pdserve.sim.run import instance_kv_config, spec_from_up_flags
from pdserve.workload.requests import BenchRequest

BS = 4


@pytest.fixture(scope="module")
def g4_dir(tmp_path_factory) -> Path:
    from pdserve.model.tiny import TinySpec, make_tiny

    return Path(
        make_tiny(tmp_path_factory.mktemp("g4s") / "g4", TinySpec(family="gemma4", vocab=512))
    )


@pytest.fixture(scope="module")
def shape(g4_dir) -> ModelShape:
    return ModelShape.from_config(json.loads((g4_dir / "config.json").read_text()))


@pytest.fixture
def engine(g4_dir, make_engine):
    from pdserve.model.loader import load_model

    loaded = load_model(g4_dir, dtype="float32")

    def factory(**kw):
        kw.setdefault("block_size", BS)
        kw.setdefault("max_num_batched_tokens", 64)
        kw.setdefault("max_num_seqs", 8)
        return make_engine(loaded=loaded, dtype="float32", **kw)

    return factory


def _costs(shape: ModelShape) -> CostModel:
    window, per_token = shape.window_group(4) or (0, 0)
    return CostModel(
        step=StepCost(base_s=0.010, per_token_s=0.001),
        kv_bytes_per_token=shape.kv_bytes_per_token(4),
        kv_window=window,
        kv_window_bytes_per_token=per_token,
    )


def test_split_and_pool_sizes_equal_the_engines(engine, shape):
    budget = 60_000
    e = engine(num_blocks=None, kv_cache_bytes=budget)
    costs = _costs(shape)
    assert e.window is not None and costs.kv_window == e.window
    full_b, win_b = e.spec.group_block_bytes()
    assert costs.kv_window_bytes_per_token * BS == win_b
    assert costs.kv_bytes_per_token * BS == full_b + win_b == e.spec.bytes_per_block
    pools = instance_kv_config(
        costs, BS, e.max_model_len, 8, budget, max_num_batched_tokens=64, chunked_prefill=True
    )
    assert pools == {
        "num_blocks": e.num_blocks,
        "window": e.window,
        "window_blocks": e.num_window_blocks,
    }
    # a prefill pushes what the engine's spec sends: the sliding layers' last window only
    for n in (1, 7, 24, 25, 60, 130):
        assert costs.transfer_bytes(n, BS) == e.spec.transfer_bytes(n)
    assert costs.transfer_bytes(130, BS) < -(-130 // BS) * BS * costs.kv_bytes_per_token


def test_one_pool_when_asked_or_uniform(shape):
    costs = _costs(shape)
    kw = dict(max_num_batched_tokens=64, chunked_prefill=True)
    one = instance_kv_config(costs, BS, 4096, 8, 60_000, window_pool=False, **kw)
    assert one == {"num_blocks": 60_000 // (costs.kv_bytes_per_token * BS)}
    llama = roofline_costs("llama3-8b", "h100")
    assert llama.kv_window == 0 and llama.kv_window_bytes_per_token == 0
    assert set(instance_kv_config(llama, 16, 8192, 256, 10**9, **kw)) == {"num_blocks"}
    assert llama.transfer_bytes(100, 16) == 112 * llama.kv_bytes_per_token


def test_real_gemma4_shape_gets_a_window_pool():
    shape = load_model_config("gemma4-31b")
    costs = roofline_costs(shape, "h100x2")
    window, per_token = shape.window_group(2)
    assert costs.kv_window == window == 1024
    assert 0 < costs.kv_window_bytes_per_token == per_token < costs.kv_bytes_per_token
    spec = spec_from_up_flags(["--mode", "colocated", "--colocated", "1"], costs, 8192)
    cfg = spec.pools[0].config
    assert cfg.window == 1024 and cfg.window_blocks is not None
    flat = spec_from_up_flags(
        ["--mode", "colocated", "--colocated", "1", "--worker-arg=--no-window-pool"], costs, 8192
    )
    assert flat.pools[0].config.window is None
    assert cfg.num_blocks > flat.pools[0].config.num_blocks  # the same bytes hold more tokens


def _reqs(n: int, n_in: int, n_out: int) -> list[BenchRequest]:
    return [
        BenchRequest(i, [7 + (i * 131 + k) % 500 for k in range(n_in)], n_out, arrival_s=0.0)
        for i in range(n)
    ]


def _pool(shape: ModelShape, role: str, budget: int, window_pool: bool) -> PoolSpec:
    costs = _costs(shape)
    pools = instance_kv_config(
        costs, BS, 4096, 8, budget, max_num_batched_tokens=64, chunked_prefill=True,
        window_pool=window_pool,
    )  # fmt: skip
    cfg = InstanceConfig(**pools, block_size=BS, max_num_batched_tokens=64, max_num_seqs=8)
    return PoolSpec(role, 1, costs, cfg)


def test_simulated_runs_free_window_blocks_and_fit_a_larger_batch(shape):
    budget = 400_000  # one pool: 111 blocks (4 requests of 25); window pool: 289 + 81
    arms = {}
    for window_pool in (True, False):
        spec = ClusterSpec([_pool(shape, "colocated", budget, window_pool)], policy="least_loaded")
        cl = SimCluster(spec)
        inst = next(iter(cl.instances.values()))
        recs = cl.run(_reqs(24, 40, 60))
        assert all(r.ok and r.n_out == 60 for r in recs)
        kv = inst.kv
        kv.check_integrity([])
        assert kv.num_free_blocks == kv.num_blocks
        assert kv.num_free_window_blocks == kv.num_window_blocks
        arms[window_pool] = (kv.num_blocks, max(r.finish_s for r in recs))
    # the same bytes: the main pool holds 2.6x the blocks, and the burst ends sooner (a
    # decode batch of 8 instead of 4)
    assert arms[True][0] > 2.5 * arms[False][0]
    assert arms[True][1] < 0.8 * arms[False][1]


def test_disaggregated_push_is_the_window_and_lands_in_the_window_pool(shape):
    pre = _pool(shape, "prefill", 200_000, True)
    dec = _pool(shape, "decode", 200_000, True)
    cl = SimCluster(ClusterSpec([pre, dec], policy="least_loaded"))
    recs = cl.run(_reqs(4, 90, 30))
    assert all(r.ok and r.n_out == 30 for r in recs)
    costs = pre.costs
    for r in recs:
        assert r.stages["transfer_bytes"] == costs.transfer_bytes(90, BS)
    for inst in cl.instances.values():
        inst.kv.check_integrity([])
        assert inst.kv.num_free_window_blocks == inst.kv.num_window_blocks


def test_a_request_larger_than_the_pool_is_refused_not_waited_for(shape):
    pool = _pool(shape, "colocated", 40_000, True)  # 10 main blocks of 4 tokens
    cl = SimCluster(ClusterSpec([pool], policy="least_loaded"))
    recs = cl.run([*_reqs(2, 20, 30), BenchRequest(9, list(range(7, 37)), 4, arrival_s=0.0)])
    assert [r.ok for r in recs] == [False, False, True]
    assert "exceeds this engine's KV capacity of 40 tokens" in (recs[0].error or "")


def test_kvstore_keeps_window_parts_of_the_chain_end_only(shape):
    """Round robin sends a repeat of a 100-token prompt (25 blocks of 4) to the other
    instance: the store holds 25 main parts and the window parts of the last
    ceil(24 / 4) + 1 = 7 blocks (as kv.footprint's store stage), and serves the hit from them."""
    from dataclasses import replace

    from pdserve.costmodel.costs import LinkCost

    pool = _pool(shape, "colocated", 400_000, True)
    costs = replace(pool.costs, kvstore_fetch=LinkCost(0.002, 1e9))
    spec = ClusterSpec(
        [PoolSpec("colocated", 2, costs, pool.config)], policy="round_robin",
        session_affinity=False, kvstore_capacity_bytes=1 << 22,
    )  # fmt: skip
    cl = SimCluster(spec)
    p = [7 + k for k in range(100)]
    recs = cl.run([BenchRequest(0, p, 2, 0.0), BenchRequest(1, p, 2, 0.5)])
    assert all(r.ok for r in recs)
    main_b = (costs.kv_bytes_per_token - costs.kv_window_bytes_per_token) * BS
    win_b = costs.kv_window_bytes_per_token * BS
    assert cl.store is not None
    assert cl.store.arena.used_bytes == 25 * main_b + 7 * win_b
    cl.store.check_integrity()
    assert recs[1].stages["kvstore_tokens"] == 100
    assert recs[1].cached_tokens == 96  # the last block is recomputed
    fetched = 25 * main_b + 7 * win_b
    assert recs[1].ttft_s > 0.002 + fetched / 1e9
    for inst in cl.instances.values():
        inst.kv.check_integrity([])
