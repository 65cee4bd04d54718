"""The simulator: hand-computed latencies from known step costs, determinism for a seed, and
the real decision code (placement policies, scheduler chunking, kvstore store) in the loop."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest

from pdserve.costmodel.costs import CostModel, LinkCost, StepCost
from pdserve.router.cluster.registry import Instance
from pdserve.router.scheduling.policies import PlacementPolicy, RoundRobin, RouteRequest
from pdserve.sim.cluster import ClusterSpec, PoolSpec, SimCluster
from pdserve.sim.instance import InstanceConfig
from pdserve.workload.requests import BenchRequest, LengthDist, synthetic_requests

# step = 10 ms + 1 ms per new token; nothing else costs anything
COSTS = CostModel(step=StepCost(base_s=0.010, per_token_s=0.001), kv_bytes_per_token=100)


def _cfg(**kw) -> InstanceConfig:
    return InstanceConfig(num_blocks=kw.pop("num_blocks", 256), block_size=16, **kw)


def _req(i: int, n_in: int, n_out: int, at: float = 0.0, base: int = 100) -> BenchRequest:
    return BenchRequest(i, [base + i * 1000 + k for k in range(n_in)], n_out, arrival_s=at)


def _colocated(n: int = 1, costs: CostModel = COSTS, **kw) -> ClusterSpec:
    return ClusterSpec([PoolSpec("colocated", n, costs, _cfg(**kw))], policy="least_loaded")


def test_hand_computed_colocated_latencies():
    rec = SimCluster(_colocated()).run([_req(0, 32, 4)])[0]
    # prefill 32 tokens: 10 + 32 = 42 ms; each decode step 10 + 1 = 11 ms
    assert rec.ttft_s == pytest.approx(0.042)
    assert rec.token_times == pytest.approx([0.042, 0.053, 0.064, 0.075])
    assert rec.tpot_s == pytest.approx(0.011)
    assert rec.stages["prefill_ms"] == pytest.approx(42.0)
    assert rec.stages["decode_ms"] == pytest.approx(33.0)


def test_chunked_prefill_and_batched_decode():
    # budget 16 tokens: the 32-token prompt takes two 26 ms chunks
    rec = SimCluster(_colocated(max_num_batched_tokens=16)).run([_req(0, 32, 2)])[0]
    assert rec.token_times == pytest.approx([0.052, 0.063])
    # two 8-token prompts at t=0: the first starts a step alone (10 + 8 ms); the second's
    # prefill then shares a mixed step with the first's decode (10 + 9 ms), then decodes alone
    a, b = SimCluster(_colocated()).run([_req(0, 8, 2), _req(1, 8, 2)])
    assert a.token_times == pytest.approx([0.018, 0.037])
    assert b.token_times == pytest.approx([0.037, 0.048])


def test_hand_computed_disaggregated_latencies():
    costs = CostModel(
        step=COSTS.step,
        transfer=LinkCost(latency_s=0.005, bandwidth_Bps=3200 / 0.010),
        kv_bytes_per_token=100,
    )
    spec = ClusterSpec(
        [PoolSpec("prefill", 1, costs, _cfg()), PoolSpec("decode", 1, costs, _cfg())],
        policy="least_loaded",
    )
    rec = SimCluster(spec).run([_req(0, 32, 4)])[0]
    # prefill 42 ms; push 2 blocks x 16 tokens x 100 B = 3200 B: 5 + 10 ms; decodes 11 ms
    assert rec.token_times == pytest.approx([0.057, 0.068, 0.079, 0.090])
    assert rec.stages["transfer_ms"] == pytest.approx(15.0)
    assert rec.stages["transfer_bytes"] == 3200
    assert rec.stages["reserve_ms"] == 0.0  # the decode was idle


def test_reserve_waits_for_the_decode_step_in_flight():
    """A Reserve is an engine command: it runs between two steps. The second request arrives
    at 60 ms, during the first one's decode step 57-68 ms: its reservation takes 8 ms."""
    costs = CostModel(
        step=COSTS.step,
        transfer=LinkCost(latency_s=0.005, bandwidth_Bps=3200 / 0.010),
        kv_bytes_per_token=100,
    )
    spec = ClusterSpec(
        [PoolSpec("prefill", 1, costs, _cfg()), PoolSpec("decode", 1, costs, _cfg())],
        policy="least_loaded",
    )
    a, b = SimCluster(spec).run([_req(0, 32, 4), _req(1, 32, 2, at=0.060)])
    assert a.stages["reserve_ms"] == 0.0
    assert b.stages["reserve_ms"] == pytest.approx(8.0)


def _one_p_one_d(reserve_s: float = 0.0, overhead_s: float = 0.0) -> ClusterSpec:
    costs = CostModel(
        step=COSTS.step,
        transfer=LinkCost(latency_s=0.005, bandwidth_Bps=3200 / 0.010),
        kv_bytes_per_token=100,
        router_overhead_s=overhead_s,
        reserve_s=reserve_s,
    )
    return ClusterSpec(
        [PoolSpec("prefill", 1, costs, _cfg()), PoolSpec("decode", 1, costs, _cfg())],
        policy="least_loaded",
    )


def test_a_one_token_request_prefills_without_a_decode_or_a_push():
    """Orchestrator._prefill_only: max_tokens 1 reserves nothing and pushes nothing; token 0
    comes back with the Prefill answer (42 ms), and the decode never holds it."""
    cluster = SimCluster(_one_p_one_d())
    rec = cluster.run([_req(0, 32, 1)])[0]
    assert rec.token_times == pytest.approx([0.042]) and rec.finish_reason == "length"
    assert "transfer_ms" not in rec.stages and "reserve_ms" not in rec.stages
    dec = cluster.instances["decode-0"]
    assert dec.kv.num_reservations == 0 and dec.kv.num_free_blocks == 256
    assert all(
        (i.inflight_requests, i.inflight_tokens) == (0, 0) for i in cluster.registry.instances()
    )


def test_the_reserve_round_trip_lets_a_one_token_request_overtake_in_a_burst():
    """Two requests at once, 10 ms of path each, 3 ms of it the Reserve's round trip: the
    1-token one reaches the prefill at 7 ms and computes first (7 + 42 = 49 ms); the other
    reserves, its ticket is back at 10 ms, and its prompt waits for the step in flight
    (49 + 42 = 91 ms, then the 15 ms push)."""
    a, b = SimCluster(_one_p_one_d(reserve_s=0.003, overhead_s=0.010)).run(
        [_req(0, 32, 2), _req(1, 32, 1)]
    )
    assert b.token_times == pytest.approx([0.049])
    assert a.token_times[0] == pytest.approx(0.091 + 0.015)
    assert a.stages["reserve_ms"] == pytest.approx(3.0)
    # without the round trip both reach the prefill together, in arrival order
    a, b = SimCluster(_one_p_one_d(overhead_s=0.010)).run([_req(0, 32, 2), _req(1, 32, 1)])
    assert a.token_times[0] == pytest.approx(0.010 + 0.042 + 0.015)
    assert b.token_times == pytest.approx([0.010 + 0.084])


def test_queueing_behind_a_busy_instance():
    # the second request arrives at 20 ms, while the first one's 42 ms prefill runs
    a, b = SimCluster(_colocated()).run([_req(0, 32, 1), _req(1, 32, 1, at=0.020)])
    assert a.finish_s == pytest.approx(0.042)
    assert b.token_times[0] == pytest.approx(0.084) and b.ttft_s == pytest.approx(0.064)


def _workload(seed: int) -> list[BenchRequest]:
    from pdserve.workload.arrivals import gamma_arrivals

    reqs = synthetic_requests(
        40, LengthDist.parse("lognormal:200,0.6"), LengthDist.parse("uniform:4,40"), 1000, seed
    )
    for r, t in zip(reqs, gamma_arrivals(40, 20.0, 0.5, seed), strict=True):
        r.arrival_s = t
    return reqs


def test_deterministic_for_a_seed():
    spec = ClusterSpec(
        [PoolSpec("prefill", 1, COSTS, _cfg()), PoolSpec("decode", 2, COSTS, _cfg(num_blocks=64))]
    )
    runs = [[r.to_json() for r in SimCluster(spec).run(_workload(3))] for _ in range(2)]
    assert json.dumps(runs[0]) == json.dumps(runs[1])
    other = [r.to_json() for r in SimCluster(spec).run(_workload(4))]
    assert json.dumps(other) != json.dumps(runs[0])
    assert all(r["error"] is None for r in runs[0])


class AlwaysLast(PlacementPolicy):
    name = "always_last"

    def pick_prefill(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return candidates[-1]

    def pick_decode(self, request: RouteRequest, candidates: Sequence[Instance]) -> Instance:
        return candidates[-1]


def test_swapping_the_policy_changes_the_placement():
    reqs = [_req(i, 16, 2, at=0.1 * i) for i in range(4)]
    rr = SimCluster(_colocated(2), policy=RoundRobin())
    rr.run(reqs)
    assert rr.placements == {"colocated-0": 2, "colocated-1": 2}
    last = SimCluster(_colocated(2), policy=AlwaysLast())
    last.run(reqs)
    assert last.placements == {"colocated-0": 0, "colocated-1": 4}


def test_prefix_aware_policy_and_engine_prefix_cache():
    # the same 64-token prompt twice: prefix_aware sends it back to the instance that has it,
    # whose BlockPool serves 48 tokens (3 full blocks; the last block is recomputed)
    spec = _colocated(2)
    spec.policy = "prefix_aware"
    p = [7 + k for k in range(64)]
    reqs = [BenchRequest(0, p, 2, 0.0), BenchRequest(1, [999] * 16, 2, 0.001),
            BenchRequest(2, p, 2, 0.5)]  # fmt: skip
    recs = SimCluster(spec).run(reqs)
    assert recs[2].cached_tokens == 48
    # least_loaded has no memory of prefixes: at 0.5 s both are idle, it takes the first,
    # which also holds the prefix here; swap the order of the first two to see a miss
    reqs2 = [BenchRequest(0, [999] * 16, 2, 0.0), BenchRequest(1, p, 2, 0.001),
             BenchRequest(2, p, 2, 0.5)]  # fmt: skip
    assert SimCluster(spec).run(reqs2)[2].cached_tokens == 48
    spec_ll = _colocated(2)
    assert SimCluster(spec_ll).run(reqs2)[2].cached_tokens == 0


def test_kvstore_serves_a_prefix_computed_elsewhere():
    costs = CostModel(step=COSTS.step, kvstore_fetch=LinkCost(0.002, 1e9), kv_bytes_per_token=100)
    spec = ClusterSpec(
        [PoolSpec("colocated", 2, costs, _cfg())], policy="round_robin",
        session_affinity=False, kvstore_capacity_bytes=1 << 20,
    )  # fmt: skip
    p = [7 + k for k in range(64)]
    recs = SimCluster(spec).run([BenchRequest(0, p, 2, 0.0), BenchRequest(1, p, 2, 0.5)])
    # round robin sends the repeat to the other instance: its 4 full blocks come from the store
    assert recs[1].stages["kvstore_tokens"] == 64
    assert recs[1].cached_tokens == 48
    # fetch 2 ms + 6400 B at 1 GB/s, then a 16-token step (10 + 16 ms)
    assert recs[1].ttft_s == pytest.approx(0.002 + 6400 / 1e9 + 0.026)


def test_preemption_under_memory_pressure_still_completes():
    # 6 blocks of 16 tokens; three 32-token prompts growing to 60 tokens cannot all fit
    cl = SimCluster(_colocated(num_blocks=8))
    recs = cl.run([_req(i, 32, 28) for i in range(3)])
    assert all(r.ok and r.n_out == 28 for r in recs)
    assert sum(i.scheduler.num_preemptions for i in cl.instances.values()) > 0


def test_step_cost_fit_recovers_coefficients():
    truth = StepCost(0.004, 0.0005, 0.0002, 0.00001, 1e-7)
    batches = [[(0, n)] for n in (16, 64, 256, 512)] + [
        [(c, 1)] * b for b in (1, 4, 16) for c in (64, 512)
    ]
    times = [truth.step_s(b) for b in batches]
    fit = StepCost.fit(batches, times)
    for b, t in zip(batches, times, strict=True):
        assert fit.step_s(b) == pytest.approx(t, rel=1e-6)


def test_early_stop_only_when_the_target_is_out_of_reach():
    from pdserve.workload.goodput import SLO, attainment

    # 40 requests 5 ms apart on one instance: each waits behind the earlier prefills
    reqs = [_req(i, 64, 8, at=0.005 * i) for i in range(40)]
    full = SimCluster(_colocated())
    recs = full.run(reqs)
    slo_ttft = sorted(r.ttft_s for r in recs)[19]  # exactly 20 of 40 meet this TTFT
    slo = SLO(ttft_ms=slo_ttft * 1e3, tpot_ms=1e3)
    stopped = SimCluster(_colocated())
    stopped.stop_early(slo_ttft, 1.0, max_misses=4)  # target 90 %: > 4 misses decides it
    part = stopped.run(reqs)
    assert stopped.misses > 4 and stopped.loop.events < full.loop.events
    assert attainment(part, slo) <= attainment(recs, slo) < 0.9  # a lower bound, same verdict
    relaxed = SimCluster(_colocated())
    relaxed.stop_early(10.0, 10.0, max_misses=4)  # every request meets it: runs to the end
    assert all(r.ok for r in relaxed.run(reqs))


def test_flip_policy_moves_a_decode_instance_to_a_starved_prefill_pool():
    from pdserve.router.cluster.registry import ROLE_PREFILL
    from pdserve.router.flip.policy import FlipThresholds

    # long prompts (522 ms of prefill each) at 2.5 req/s, two output tokens: the prefill pool
    # starves while 3 decode instances with room to spare idle
    spec = ClusterSpec(
        [
            PoolSpec("prefill", 1, COSTS, _cfg()),
            PoolSpec("decode", 3, COSTS, _cfg(num_blocks=4096)),
        ],
        policy="least_loaded",
        flip=FlipThresholds(prefill_tokens_full=256, ticks=2, cooldown_s=1.0),
        flip_interval_s=0.5,
    )
    reqs = [_req(i, 512, 2, at=0.4 * i) for i in range(80)]
    cl = SimCluster(spec)
    recs = cl.run(reqs)
    assert all(r.ok for r in recs)
    assert cl.flips and cl.flips[0]["to"] == ROLE_PREFILL
    assert sum(i.role == ROLE_PREFILL for i in cl.instances.values()) >= 2
    # the same run without the flip controller keeps one prefill instance and is slower
    spec.flip = None
    slow = SimCluster(spec).run(reqs)
    assert max(r.finish_s for r in slow) > max(r.finish_s for r in recs)


def test_simulated_run_writes_bench_serve_json_that_rescore_reads(tmp_path):
    from pdserve.bench.rescore import rescore
    from pdserve.bench.serve import save_result
    from pdserve.cli.main import build_parser
    from pdserve.sim.run import simulate_benchmark, spec_from_up_flags
    from pdserve.workload.goodput import SLO

    args = build_parser().parse_args(
        [
            "sim",
            "run",
            "--vocab-size",
            "1000",
            "--max-model-len",
            "2048",
            "--num-requests",
            "30",
            "--input-len",
            "fixed:64",
            "--output-len",
            "fixed:8",
            "--goodput",
            "ttft:200",
            "tpot:50",
            "--sweep-rates",
            "2,8,32",
        ]
    )
    spec = spec_from_up_flags(["--mode", "colocated", "--colocated", "2"], COSTS, 2048)
    assert [(p.role, p.count) for p in spec.pools] == [("colocated", 2)]
    result = simulate_benchmark(spec, args)
    paths = save_result(result, tmp_path / "sim.json", None)
    assert paths[0].exists() and any(p.name == "attainment.png" for p in paths)
    saved = json.loads(paths[0].read_text())
    assert saved["config"]["simulated"] and len(saved["sweep"]) == 3
    att = [r["attainment_ttft_tpot"] for r in saved["sweep"]]
    assert att[0] == 1.0 and att[-1] < att[0]  # 32 req/s overloads two 10 ms + 1 ms/token engines
    scored = rescore(saved, SLO(ttft_ms=200, tpot_ms=50), 0.9)
    assert scored["run"]["attainment"] == {2.0: att[0], 8.0: att[1], 32.0: att[2]}


def test_allowed_misses_is_the_attainment_boundary():
    """The early stop allows exactly the misses that keep (n - misses) / n >= target, the
    way `bench.goodput.attainment` computes it (int(0.1 * 540) = 53 was one short)."""
    from pdserve.sim.run import allowed_misses

    assert allowed_misses(540, 0.9) == 54
    for target in (0.5, 0.9, 0.95, 0.99, 1.0):
        for n in range(1, 1500):
            m = allowed_misses(n, target)
            assert (n - m) / n >= target
            assert m == n or (n - m - 1) / n < target


def test_prompt_hashes_are_the_managers_and_private_to_each_sequence():
    from pdserve.sim.instance import SimInstance

    prompt = list(range(100, 150))  # 3 full blocks of 16
    a = SimInstance("a", 1, CostModel(), InstanceConfig(num_blocks=64))
    b = SimInstance("b", 1, CostModel(), InstanceConfig(num_blocks=64))
    sa = a.add("r1", prompt, 4, prefill_only=False)
    sb = b.add("r1", prompt, 4, prefill_only=False)
    assert sa.block_hashes == a.kv.compute_block_hashes(prompt) and len(sa.block_hashes) == 3
    assert sa.block_hashes is not sb.block_hashes  # seq_hashes extends each in place
    sa.block_hashes.append(b"x" * 16)
    assert len(sb.block_hashes) == 3
