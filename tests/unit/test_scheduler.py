"""Scheduler tests with a fake model: the 'next token' is a function of the sequence, so we can
check plans and accounting without tensors."""

from pdserve.engine.params import SamplingParams
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence
from pdserve.kv.cache_manager import KVCacheManager

BS = 4


def make(num_blocks=64, budget=16, max_seqs=8, caching=True):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, kv_fingerprint="test")
    return kv, Scheduler(kv, budget, max_seqs)


def seq(rid, n, max_tokens=4, start=0):
    return Sequence(rid, list(range(start, start + n)), SamplingParams(max_tokens=max_tokens))


def run_step(sched, finished):
    plan = sched.schedule()
    sampled = {e.seq.request_id: 7 for e in plan.scheduled if e.sample}
    for e in sched.update(plan, sampled):
        if e.seq.num_output_tokens >= e.seq.params.max_tokens:
            sched.finish(e.seq, "length")
            finished.append(e.seq.request_id)
    return plan


def test_chunked_prefill_respects_budget_and_decodes_first():
    pool, sched = make(budget=8)
    a = seq("a", 3, max_tokens=10)
    sched.add(a)
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 3}
    sched.update(plan, {"a": 1})
    b = seq("b", 20, start=100)
    sched.add(b)
    plan = sched.schedule()
    # a decodes first (1 token), b's prefill gets the remaining 7
    assert [e.seq.request_id for e in plan.scheduled] == ["a", "b"]
    assert plan.num_scheduled_tokens == {"a": 1, "b": 7}
    assert plan.total_tokens <= 8
    assert plan.scheduled[1].sample is False
    sched.update(plan, {"a": 1})
    assert b.num_computed_tokens == 7 and len(b.block_table) == 2
    plan = sched.schedule()
    assert plan.num_scheduled_tokens == {"a": 1, "b": 7}
    pool.check_integrity(sched.iter_all())


def test_max_num_seqs_limits_running():
    _, sched = make(max_seqs=2)
    for i in range(3):
        sched.add(seq(str(i), 2))
    plan = sched.schedule()
    assert set(plan.num_scheduled_tokens) == {"0", "1"}
    assert len(sched.waiting) == 1


def test_all_finish_and_blocks_return():
    pool, sched = make(budget=10)
    for i in range(5):
        sched.add(seq(str(i), 3 + 4 * i, start=1000 * i))
    finished = []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        run_step(sched, finished)
        pool.check_integrity(sched.iter_all())
    assert sorted(finished) == [str(i) for i in range(5)]
    assert pool.num_free_blocks == 64
    pool.check_integrity(sched.iter_all())


def test_preemption_newest_goes_back_and_keeps_outputs():
    # 4 blocks of 4 tokens: two sequences of 6 prompt tokens + 8 outputs cannot both fit
    pool, sched = make(num_blocks=4, budget=32, caching=False)
    a, b = seq("a", 6, max_tokens=8), seq("b", 6, max_tokens=8, start=50)
    sched.add(a)
    sched.add(b)
    finished, preempted = [], []
    for _ in range(100):
        if not sched.has_unfinished():
            break
        plan = run_step(sched, finished)
        preempted += plan.preempted
        pool.check_integrity(sched.iter_all())
    assert preempted and preempted[0] == "b"
    assert sorted(finished) == ["a", "b"]
    assert b.num_preemptions >= 1 and b.output_token_ids == [7] * 8
    assert pool.num_free_blocks == 4


def test_prefix_cache_hit_counts_full_blocks_and_keeps_last_token():
    pool, sched = make()
    a = seq("a", 12, max_tokens=1)
    sched.add(a)
    finished = []
    while sched.has_unfinished():
        run_step(sched, finished)
    # same 12-token prompt: 3 full blocks cached but the last token is recomputed -> 2 hit
    b = seq("b", 12, max_tokens=1)
    sched.add(b)
    plan = sched.schedule()
    assert b.num_cached_tokens == 8
    assert plan.num_scheduled_tokens == {"b": 4}
    # longer prompt sharing 3 blocks -> 3 hit
    sched.update(plan, {"b": 3})
    sched.finish(b, "length")
    c = Sequence("c", [*list(range(12)), 99, 98], SamplingParams(max_tokens=1))
    sched.add(c)
    plan = sched.schedule()
    assert c.num_cached_tokens == 12 and plan.num_scheduled_tokens == {"c": 2}
    assert pool.stats.hit_blocks == 5
    sched.update(plan, {"c": 1})
    sched.finish(c, "length")
    assert pool.num_free_blocks == 64
    pool.check_integrity(sched.iter_all())


def test_abort_waiting_and_running_frees_blocks():
    pool, sched = make(budget=4)
    a, b = seq("a", 10), seq("b", 3)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    sched.update(plan, {})
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert not sched.has_unfinished()
    assert pool.num_free_blocks == 64
    pool.check_integrity(sched.iter_all())
