"""Continuous batching: requests joining at different steps, chunked prefill and preemption
give exactly the tokens each request gives alone."""

import torch

from pdserve.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def make_prompts(n=16, seed=7):
    g = torch.Generator().manual_seed(seed)
    lens = [1 + (i * 13) % 70 for i in range(n)]
    return [torch.randint(2, 512, (m,), generator=g).tolist() for m in lens]


def solo(engine, prompts, params):
    return [engine.generate([p], params)[0] for p in prompts]


def staggered(engine, prompts, params):
    """Add request i at step 2*i; return generated tokens per request."""
    out = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step < 2 * len(prompts) or engine.has_unfinished_requests():
        if step % 2 == 0 and step // 2 < len(prompts):
            i = step // 2
            engine.add_request(str(i), prompts[i], params)
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason == "length"
        step += 1
    return [out[str(i)] for i in range(len(prompts))], step


def test_batched_equals_solo(make_engine):
    prompts = make_prompts()
    ref = solo(make_engine(), prompts, GREEDY)
    engine = make_engine(max_num_batched_tokens=48)  # forces chunked prefill
    got, _ = staggered(engine, prompts, GREEDY)
    assert got == ref
    assert engine.scheduler.num_preemptions == 0


def test_batched_equals_solo_under_preemption(make_engine):
    prompts = make_prompts()
    ref = solo(make_engine(), prompts, GREEDY)
    # 16 blocks of 16 tokens: far less than 16 requests need at once
    engine = make_engine(num_blocks=16, max_num_batched_tokens=64)
    got, _ = staggered(engine, prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    assert got == ref


def test_seeded_sampling_batched_equals_solo_under_preemption(make_engine):
    prompts = make_prompts(8, seed=11)
    params = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)
    ref = solo(make_engine(), prompts, params)
    engine = make_engine(num_blocks=8, max_num_batched_tokens=32)
    got, _ = staggered(engine, prompts, params)
    assert engine.scheduler.num_preemptions > 0
    assert got == ref


def test_abort_frees_everything(make_engine):
    engine = make_engine(max_num_batched_tokens=16)
    prompts = make_prompts(6)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(3):
        engine.step()
    for i in range(6):
        engine.abort_request(str(i))
    engine.abort_request("0")  # idempotent
    engine.abort_request("never-existed")
    assert not engine.has_unfinished_requests()
    assert engine.step() == []


def test_stop_tokens_and_eos(make_engine):
    engine = make_engine()
    p = make_prompts(1)[0]
    full = engine.generate([p], GREEDY)[0]
    stop_at = full[5]
    first = full.index(stop_at)
    out = engine.generate(
        [p],
        SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=(stop_at,)),
    )[0]
    assert out == full[: first + 1]
    # the model's EOS (id 1 in the tiny config) stops unless ignore_eos
    engine.eos_token_ids = frozenset({stop_at})
    engine.add_request("e", p, SamplingParams(max_tokens=24, temperature=0))
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    assert outs[-1].finish_reason == "stop" and len(outs) == first + 1
