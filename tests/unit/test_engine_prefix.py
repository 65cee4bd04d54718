"""Prefix cache: a request sharing a 3-block prefix with an earlier one reuses those blocks."""

import torch

from pdserve.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_shared_three_block_prefix_is_reused(make_engine):
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 512, (48,), generator=g).tolist()  # 3 blocks of 16
    a = prefix + torch.randint(2, 512, (7,), generator=g).tolist()
    b = prefix + torch.randint(2, 512, (9,), generator=g).tolist()
    ref_b = make_engine(enable_prefix_caching=False).generate([b], GREEDY)[0]

    engine = make_engine()
    engine.generate([a], GREEDY)
    hits_before = engine.kv.stats.hit_blocks
    engine.add_request("b", b, GREEDY)
    out, cached = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out += o.new_token_ids
            cached = o.num_cached_tokens
    assert cached == 48
    assert engine.kv.stats.hit_blocks - hits_before == 3
    assert engine.stats()["prefix_hit_tokens"] >= 48
    assert out == ref_b


def test_identical_prompt_recomputes_last_token(make_engine):
    p = torch.randint(2, 512, (32,), generator=torch.Generator().manual_seed(9)).tolist()
    engine = make_engine()
    first = engine.generate([p], GREEDY)[0]
    engine.add_request("again", p, GREEDY)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[0].num_cached_tokens == 16  # 2 full blocks, but the last token is recomputed
    assert [o.new_token_ids[0] for o in outs] == first


def test_no_prefix_caching_counts_nothing(make_engine):
    p = list(range(2, 40))
    engine = make_engine(enable_prefix_caching=False)
    engine.generate([p, p], GREEDY)
    assert engine.kv.stats.hit_blocks == 0


def test_held_prefix_is_pinned_until_scheduled_or_aborted(make_engine):
    """hold_prefix takes a ref on each cached prefix block (out of the evictable free list)
    while its request waits; scheduling or abort drops it (the make_engine fixture checks
    that every block is free at the end)."""
    from pdserve.engine.params import SamplingParams

    engine = make_engine(num_blocks=16)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 5 + 48))  # 3 full blocks
    engine.generate([prompt], params)
    hashes = engine.compute_block_hashes(prompt)
    blocks = engine.cached_prefix(hashes)
    assert len(blocks) == 3 and engine.kv.num_free_blocks == 16
    assert engine.hold_prefix("later", hashes) == 3
    assert [engine.kv.ref_count(b) for b in blocks] == [1, 1, 1]
    assert engine.kv.num_free_blocks == 13  # held blocks cannot be evicted
    engine.check_integrity()
    engine.add_request("later", [*prompt, 7, 8], params)
    engine.step()  # scheduled: the sequence's own refs replace the hold
    assert [engine.kv.ref_count(b) for b in blocks] == [1, 1, 1]
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.hold_prefix("never-added", hashes) == 3
    engine.abort_request("never-added")  # abort frees a hold even for an unknown request
    assert engine.kv.num_free_blocks == 16


def test_hold_on_finish_keeps_finished_blocks_until_released(make_engine):
    """The write-back hold: a finished request's computed full blocks stay referenced (so
    eviction cannot take them before the kvstore publish reads them) until release_held."""
    from pdserve.engine.params import SamplingParams

    engine = make_engine(num_blocks=16)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 5 + 40))  # 40 + 20 tokens: 59 computed -> 3 full blocks
    engine.hold_on_finish("wb")
    engine.add_request("wb", prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs.extend(engine.step())
    answer = [t for o in outputs for t in o.new_token_ids]
    hashes = engine.compute_block_hashes(prompt + answer)
    held = engine.cached_prefix(hashes)
    assert len(held) == 3
    assert all(engine.kv.ref_count(b) == 1 for b in held)
    assert engine.kv.num_free_blocks == 13
    engine.release("wb")
    assert engine.kv.num_free_blocks == 16
    # an aborted request keeps nothing
    engine.hold_on_finish("gone")
    engine.add_request("gone", prompt, params)
    engine.step()
    engine.abort_request("gone")
    assert engine.kv.num_free_blocks == 16
