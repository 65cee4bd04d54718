"""Placement policies and the output-length predictor."""

import pytest

from pdserve.kv.hashing import block_hashes
from pdserve.router.cluster.registry import Instance, LoadReport
from pdserve.router.scheduling.factory import make_policy
from pdserve.router.scheduling.policies import (
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    RouteRequest,
    SessionAffinity,
)
from pdserve.router.scheduling.predictor import EwmaPredictor


def inst(iid, inflight_tokens=0, inflight_requests=0, block_size=4, **load):
    return Instance(
        instance_id=iid,
        address=f"{iid}:1",
        role=1,
        model_fingerprint="fp",
        block_size=block_size,
        load=LoadReport(**load),
        last_heartbeat=0.0,
        inflight_tokens=inflight_tokens,
        inflight_requests=inflight_requests,
    )


def req(tokens=(1, 2, 3), session=""):
    return RouteRequest(
        "r", list(tokens), session_id=session, hasher=lambda ids, bs: block_hashes(ids, bs, "ns")
    )


def test_round_robin_cycles_per_phase():
    p = RoundRobin()
    cands = [inst("a"), inst("b"), inst("c")]
    assert [p.pick_prefill(req(), cands).instance_id for _ in range(5)] == list("abcab")
    assert [p.pick_decode(req(), cands).instance_id for _ in range(4)] == list("abca")


def test_least_loaded_prefill_uses_router_tokens_then_reported_queue():
    p = LeastLoaded()
    cands = [
        inst("a", inflight_tokens=500),
        inst("b", inflight_tokens=100),
        inst("c", inflight_tokens=100, tokens_in_flight=50),
    ]
    assert p.pick_prefill(req(), cands).instance_id == "b"
    cands = [inst("a", inflight_tokens=0, tokens_in_flight=900), inst("b", tokens_in_flight=10)]
    assert p.pick_prefill(req(), cands).instance_id == "b"


def test_least_loaded_decode_prefers_fewer_running_then_free_blocks():
    p = LeastLoaded()
    cands = [
        inst("a", inflight_requests=3),
        inst("b", inflight_requests=1, free_blocks=10),
        inst("c", inflight_requests=1, free_blocks=90),
    ]
    assert p.pick_decode(req(), cands).instance_id == "c"
    cands = [inst("a", num_running=4), inst("b", num_running=1, num_reserved=1)]
    assert p.pick_decode(req(), cands).instance_id == "b"


def test_prefix_aware_follows_the_cached_prefix():
    p = PrefixAware()
    cands = [inst("a"), inst("b")]
    prompt = list(range(40))
    r1 = req(prompt)
    first = p.pick_prefill(r1, cands)
    assert first.instance_id == "a"  # nothing cached anywhere: least loaded (tie -> first)
    p.on_routed(r1, first, None)
    cands[0].inflight_tokens = 30  # a is now busier, but holds the prefix
    r2 = req([*prompt[:32], 999, 998, 997, 996])
    assert p.matched_blocks(cands[0], r2.hashes_for(4)) == 8
    assert p.pick_prefill(r2, cands).instance_id == "a"
    assert p.pick_prefill(req([7] * 40), cands).instance_id == "b"  # unrelated prompt


def test_prefix_aware_balance_guard_and_forget():
    p = PrefixAware(balance_tokens=100)
    a, b = inst("a"), inst("b")
    r = req(list(range(16)))
    p.on_routed(r, a, None)
    a.inflight_tokens = 1000  # far busier than b: the match does not win
    assert p.pick_prefill(r, [a, b]).instance_id == "b"
    a.inflight_tokens = 0
    assert p.pick_prefill(r, [a, b]).instance_id == "a"
    p.forget("a")
    b.inflight_tokens = 5
    assert p.pick_prefill(r, [a, b]).instance_id == "a"  # least loaded, no prefix knowledge
    assert p.matched_blocks(a, r.hashes_for(4)) == 0


def test_prefix_aware_lru_capacity():
    p = PrefixAware(capacity_blocks=4)
    a = inst("a")
    p.on_routed(req(list(range(32))), a, None)  # 8 blocks, keeps the 4 most recent
    assert p.matched_blocks(a, req(list(range(32))).hashes_for(4)) == 0  # first blocks evicted


def test_prefix_aware_match_wins_only_when_it_saves_more_than_the_queue_costs():
    p = PrefixAware()
    a, b = inst("a"), inst("b")
    prompt = list(range(100))  # 25 blocks of 4
    p.on_routed(req(prompt[:80]), a, None)  # a holds the first 80 tokens
    r = req(prompt)
    # a: 79 queued + 20 uncached = 99 < b: 0 + 100 -> the match saves more than it waits
    a.inflight_tokens = 79
    assert p.pick_prefill(r, [a, b]).instance_id == "a"
    # a: 80 + 20 = 100 = b's 100: a tie goes to the least loaded
    a.inflight_tokens = 80
    assert p.pick_prefill(r, [a, b]).instance_id == "b"
    # a third instance holding nothing but idle does not beat a cheaper match
    c = inst("c")
    a.inflight_tokens = 10
    assert p.pick_prefill(r, [a, b, c]).instance_id == "a"


def test_prefix_aware_remembers_as_much_as_the_instance_pool_holds():
    p = PrefixAware(capacity_blocks=4)
    big, small = inst("big", total_blocks=64), inst("small")  # small reports no pool size
    prompt = list(range(128))  # 32 blocks of 4
    p.on_routed(req(prompt), big, None)
    p.on_routed(req(prompt), small, None)
    assert p.matched_blocks(big, req(prompt).hashes_for(4)) == 32  # pool of 64 keeps them all
    assert p.matched_blocks(small, req(prompt).hashes_for(4)) == 0  # fallback 4: head evicted
    capped = PrefixAware(max_blocks=8)  # the router's own memory bound wins over the pool
    capped.on_routed(req(prompt), big, None)
    assert capped.matched_blocks(big, req(prompt).hashes_for(4)) == 0
    assert capped.matched_blocks(big, req(prompt[:32]).hashes_for(4)) == 0


def test_session_affinity_sticks_while_instance_lives():
    p = SessionAffinity(LeastLoaded())
    a, b = inst("a"), inst("b", inflight_tokens=10)
    r = req(session="s1")
    chosen = p.pick_prefill(r, [a, b])
    p.on_routed(r, chosen, None)
    assert chosen.instance_id == "a"
    a.inflight_tokens = 10_000
    assert p.pick_prefill(req(session="s1"), [a, b]).instance_id == "a"
    assert p.pick_prefill(req(session="s2"), [a, b]).instance_id == "b"
    assert p.pick_prefill(req(session="s1"), [b]).instance_id == "b"  # a not a candidate
    p.forget("a")
    assert p.session_instance("s1") is None


def test_make_policy():
    assert make_policy("round_robin").name == "round_robin"
    assert make_policy("prefix_aware", session_affinity=True).name == "prefix_aware+session"
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("nope")


def test_ewma_predictor():
    p = EwmaPredictor(alpha=0.5, initial=10)
    assert p.predict(5, max_tokens=100) == 10
    assert p.predict(5, max_tokens=4) == 4
    p.observe(5, 30)
    assert p.predict(5, max_tokens=100) == 20
    p.observe(5, 0)  # aborted before any token: ignored
    assert p.predict(5, max_tokens=100) == 20
    with pytest.raises(ValueError):
        EwmaPredictor(alpha=0)
