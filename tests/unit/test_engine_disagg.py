"""Disaggregation hooks in-process: prefill-only on engine A streams per-layer KV, which is
written into reserved blocks of engine B; B decodes the rest. Tokens == one engine's."""

import torch

from pdserve.engine.params import SamplingParams


def prompt(n=41, seed=13):
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def disagg_generate(prefill, decode, rid, p, params):
    layers: dict[int, torch.Tensor] = {}

    def sink(layer, kv):
        layers[layer] = kv

    prefill.add_request(rid, p, params, prefill_only=True, kv_sink=sink)
    outs = []
    while prefill.has_unfinished_requests():
        outs += prefill.step()
    assert len(outs) == 1 and outs[0].finish_reason == "prefill_done"
    first = outs[0].new_token_ids[0]
    n_blocks = -(-len(p) // 16)
    assert sorted(layers) == list(range(prefill.spec.num_layers))
    assert layers[0].shape == (n_blocks, 2, 16, prefill.spec.num_kv_heads, prefill.spec.head_dim)

    decode.reserve(rid, len(p) + params.max_tokens)
    for layer, kv in layers.items():
        decode.write_kv(rid, layer, kv)
    done = decode.add_prefilled_request(rid, p, first, params)
    tokens = [first]
    if done is not None:
        return tokens
    while decode.has_unfinished_requests():
        for o in decode.step():
            tokens += o.new_token_ids
    return tokens


def test_prefill_then_decode_equals_single_engine_greedy(make_engine):
    p = prompt()
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    ref = make_engine().generate([p], params)[0]
    assert disagg_generate(make_engine(), make_engine(), "r", p, params) == ref


def test_seed_position_derivation_across_engines(make_engine):
    p = prompt(37, seed=2)
    params = SamplingParams(max_tokens=30, temperature=0.8, seed=1234, ignore_eos=True)
    ref = make_engine().generate([p], params)[0]
    assert make_engine().generate([p], params)[0] == ref  # reproducible
    other_seed = SamplingParams(max_tokens=30, temperature=0.8, seed=99, ignore_eos=True)
    assert make_engine().generate([p], other_seed)[0] != ref
    assert disagg_generate(make_engine(), make_engine(), "r", p, params) == ref


def test_prefilled_request_that_ends_at_token0_and_free_blocks(make_engine):
    engine = make_engine()
    p = prompt(10)
    blocks = engine.reserve("x", 40)
    assert len(blocks) == 3 and engine.kv.num_free_blocks == engine.num_blocks - 3
    out = engine.add_prefilled_request("x", p, 5, SamplingParams(max_tokens=1))
    assert out is not None and out.finished and out.finish_reason == "length"
    assert engine.kv.num_free_blocks == engine.num_blocks and engine.kv.num_reservations == 0
    engine.reserve("y", 20)
    assert engine.kv.num_free_blocks == engine.num_blocks - 2
    assert engine.release("y") == 2
    assert engine.release("y") == 0  # idempotent
    assert engine.kv.num_free_blocks == engine.num_blocks
    engine.check_integrity()


def test_read_blocks_and_import_cached_blocks(make_engine):
    p = prompt(50, seed=4)  # 3 full blocks
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    a = make_engine()
    ref = a.generate([p], params)[0]
    hashes = a.compute_block_hashes(p)[:3]
    ids = a.cached_prefix(hashes)
    assert len(ids) == 3
    data = a.read_blocks(ids)
    assert data.shape == (3, a.spec.num_layers, 2, 16, a.spec.num_kv_heads, a.spec.head_dim)

    b = make_engine()
    assert b.import_cached_blocks(hashes, data) == 3
    assert b.import_cached_blocks(hashes, data) == 0  # already cached
    b.add_request("r", p, params)
    outs = []
    while b.has_unfinished_requests():
        outs += b.step()
    assert outs[0].num_cached_tokens == 48
    assert [o.new_token_ids[0] for o in outs] == ref
    # imported data really is used: corrupt blocks in a third engine change the output
    c = make_engine()
    c.import_cached_blocks(hashes, torch.randn_like(data))
    assert c.generate([p], params)[0] != ref
