"""`chunked_prefill=False` (vLLM <= 0.3: prefill priority, whole prompts): the scheduler's
plans, the engine's exact tokens under it, and the simulator running the same mode."""

from __future__ import annotations

import torch

from pdserve.costmodel.costs import CostModel, StepCost
from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.kv.cache_manager import KVCacheManager
from pdserve.sim.cluster import SimCluster
from pdserve.sim.run import spec_from_up_flags
from pdserve.workload.requests import BenchRequest

BS = 4


def make(num_blocks=64, budget=16, max_seqs=8):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, kv_fingerprint="t")
    return kv, Scheduler(kv, budget, max_seqs, chunked_prefill=False)


def seq(rid, n, max_tokens=4, start=0):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def step(sched, plan=None):
    plan = plan or sched.schedule()
    for e in sched.update(plan, {e.seq.request_id: 7 for e in plan.scheduled if e.sample}):
        if e.seq.num_output_tokens >= e.seq.params.max_tokens:
            sched.finish(e.seq, "length")
    return plan


def kinds(plan):
    return {"prefill" if e.num_new_tokens > 1 or e.start == 0 else "decode" for e in plan.scheduled}


def test_whole_prompts_first_and_decodes_wait():
    kv, sched = make(budget=16)
    sched.add(seq("a", 30, max_tokens=5))  # longer than the budget: goes whole, alone
    sched.add(seq("b", 6, start=100))
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"a": 30}  # not chunked; b does not fit beside it
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"b": 6}  # a prompt waits: a's decode waits too
    sched.add(seq("c", 5, start=200))
    sched.add(seq("d", 5, start=300))
    plan = step(sched)
    assert plan.num_scheduled_tokens == {"c": 5, "d": 5}  # prefill step of whole prompts
    plan = step(sched)
    assert kinds(plan) == {"decode"} and len(plan.scheduled) == 4  # every running request
    while sched.has_unfinished():
        step(sched)
    assert kv.num_free_blocks == 64


def test_chunked_mode_mixes_and_chunks_the_same_queue():
    kv = KVCacheManager(64, BS, enable_prefix_caching=True, kv_fingerprint="t")
    sched = Scheduler(kv, 16, 8)  # default: chunked
    sched.add(seq("a", 30, max_tokens=5))
    assert step(sched).num_scheduled_tokens == {"a": 16}


def test_decode_step_preempts_the_newest_when_blocks_run_out():
    kv, sched = make(num_blocks=6, budget=64)
    sched.add(seq("a", 8, max_tokens=10))
    sched.add(seq("b", 8, max_tokens=10, start=50))
    step(sched)  # both prompts: 4 blocks
    preempted = []
    for _ in range(12):
        plan = step(sched)
        preempted += plan.preempted
        assert kinds(plan) in ({"decode"}, {"prefill"}, set())
    assert preempted and preempted[0] == "b"
    while sched.has_unfinished():
        step(sched)
    assert kv.num_free_blocks == 6


def _prompts(n=10, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (1 + (i * 17) % 60,), generator=g).tolist() for i in range(n)]


def test_engine_no_chunk_gives_the_tokens_of_solo_runs(make_engine):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = _prompts()
    ref = [make_engine().generate([p], params)[0] for p in prompts]
    engine = make_engine(num_blocks=12, max_num_batched_tokens=32, chunked_prefill=False)
    plans = []
    schedule = engine.scheduler.schedule

    def spy():
        plan = schedule()
        plans.append([(e.start, e.num_new_tokens) for e in plan.scheduled])
        return plan

    engine.scheduler.schedule = spy
    out = {str(i): [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    assert [out[str(i)] for i in range(len(prompts))] == ref
    assert engine.scheduler.num_preemptions > 0  # 12 blocks of 16: recompute happened
    for plan in plans:  # never a mixed step; a prompt is never split
        is_prefill = [start == 0 or n > 1 for start, n in plan]
        assert all(is_prefill) or not any(is_prefill)
        if all(is_prefill):
            assert all(start == 0 for start, _ in plan)


def test_simulator_runs_the_mode_from_the_worker_flag():
    costs = CostModel(step=StepCost(base_s=0.005, per_token_s=0.0002), kv_bytes_per_token=10)
    reqs = [BenchRequest(0, list(range(10, 60)), 200, arrival_s=0.0),
            BenchRequest(1, list(range(100, 2100)), 5, arrival_s=0.2)]  # fmt: skip
    res = {}
    for name, flag in (("chunked", "--chunked-prefill"), ("no-chunk", "--no-chunked-prefill")):
        up = ["--mode", "colocated", "--colocated", "1",
              "--worker-arg", f"--max-num-batched-tokens=256 {flag}"]  # fmt: skip
        spec = spec_from_up_flags(up, costs, 4096)
        assert spec.pools[0].config.chunked_prefill is (name == "chunked")
        recs = SimCluster(spec).run([BenchRequest(**vars(r)) for r in reqs])
        gaps = [b - a for a, b in zip(recs[0].token_times, recs[0].token_times[1:], strict=False)]
        res[name] = (recs[1].ttft_s, max(gaps))
    # no chunking: the long prompt goes in one step (earlier first token) and stalls the
    # running decode for that whole step; chunked: 8 chunks, each beside a decode
    assert res["no-chunk"][0] < res["chunked"][0]
    assert res["no-chunk"][1] > 2 * res["chunked"][1]
