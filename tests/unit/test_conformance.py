"""Conformance: a request's tokens are the same whatever else runs and however it runs.

The reference of every request is the request run ALONE on a fresh engine, its prompt in one
step. Each test runs the same requests another way and requires identical tokens, in bf16 and
fp32, greedy and seeded sampling (temperature 0.8, top-p 0.9): all at once (one batch mix),
staggered arrivals under two chunk sizes, preemption, a local prefix-cache hit, a resumed
stream (what migration and failover replay), prefill on one engine and decode on another (the
disaggregated path, KV moved as bytes), and another torch thread count. The last test runs the
batch-variant engine (`batch_invariant=False`) on the same inputs and requires a difference:
the suite can fail, and does on the old kernels.

Model: tiny qwen2 (q/k/v bias, tied lm_head, GQA 4:2), prompts from 1 to 300 tokens (past the
64-key attention tile and the 256-token query block). Budget: ~30 s on 2 shared cores.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from pdserve.engine.engine import EngineConfig, LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.model.loader import load_model
from pdserve.model.tiny import TinySpec, make_tiny
from tests.unit.test_engine_batching import staggered
from tests.unit.test_engine_disagg import disagg_generate

DTYPES = ("bfloat16", "float32")
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
PARAMS = {"greedy": GREEDY, "seeded": SEEDED}
LENS = (1, 5, 17, 40, 63, 64, 65, 100, 130, 300)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    spec = TinySpec(family="qwen2", tie=True, vocab=512, max_pos=1024)
    return make_tiny(tmp_path_factory.mktemp("conformance") / "qwen2", spec)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return {dt: load_model(model_dir, dtype=dt) for dt in DTYPES}


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENS]


def engine(loaded, dtype: str, **kw) -> LLMEngine:
    kw.setdefault("num_blocks", 256)
    kw.setdefault("max_num_batched_tokens", 1024)
    lm = loaded[dtype]
    return LLMEngine(EngineConfig(model_dir=lm.model_dir, dtype=dtype, **kw), loaded=lm)


_REFS: dict[tuple[str, str], list[list[int]]] = {}


def reference(loaded, dtype: str, kind: str) -> list[list[int]]:
    """Each request alone, its whole prompt in one step (cached per dtype and params)."""
    key = (dtype, kind)
    if key not in _REFS:
        _REFS[key] = [
            engine(loaded, dtype, enable_prefix_caching=False).generate([p], PARAMS[kind])[0]
            for p in prompts()
        ]
    return _REFS[key]


@pytest.mark.parametrize("kind", PARAMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_batch_mix_chunking_and_preemption(loaded, dtype, kind):
    ref = reference(loaded, dtype, kind)
    params = PARAMS[kind]
    assert engine(loaded, dtype).generate(prompts(), params) == ref, "all at once"
    for budget in (48, 97):  # two chunkings of every prompt, staggered arrivals
        got, _ = staggered(engine(loaded, dtype, max_num_batched_tokens=budget), prompts(), params)
        assert got == ref, f"chunk budget {budget}"
    small = engine(loaded, dtype, num_blocks=20, max_num_batched_tokens=64)
    got, _ = staggered(small, prompts(), params)
    assert small.scheduler.num_preemptions > 0
    assert got == ref, "under preemption"


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefix_cache_hit_and_resume(loaded, dtype):
    ref = reference(loaded, dtype, "seeded")
    e = engine(loaded, dtype)
    for p, want in zip(prompts(), ref, strict=True):
        e.generate([p], SEEDED)  # fills the prefix cache
        rid = f"again-{len(p)}"
        e.add_request(rid, p, SEEDED)
        got, cached = [], 0
        while e.has_unfinished_requests():
            for o in e.step():
                got += o.new_token_ids
                cached = max(cached, o.num_cached_tokens)
        assert got == want, f"prefix-cache hit, prompt {len(p)}"
        assert cached >= (len(p) - 1) // 16 * 16
        # a stream resumed after k tokens (migration / failover replay): prompt + k tokens
        for k in (1, 7):
            resumed = replace(SEEDED, max_tokens=SEEDED.max_tokens - k, output_offset=k)
            assert want[:k] + e.generate([p + want[:k]], resumed)[0] == want, f"resume k={k}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_disaggregated_and_thread_count(loaded, dtype):
    ref = reference(loaded, dtype, "greedy")
    seeded = reference(loaded, dtype, "seeded")
    pf, dec = engine(loaded, dtype), engine(loaded, dtype)
    for i, p in enumerate(prompts()):
        assert disagg_generate(pf, dec, f"g{i}", p, GREEDY) == ref[i], f"disagg {len(p)}"
        assert disagg_generate(pf, dec, f"s{i}", p, SEEDED) == seeded[i], f"disagg {len(p)}"
    threads = torch.get_num_threads()
    try:
        for n in {1, 2, 3} - {threads}:
            torch.set_num_threads(n)
            assert engine(loaded, dtype).generate(prompts(), GREEDY) == ref, f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_the_batch_variant_engine_fails_the_same_check(model_dir):
    """The all-at-once check on batch_invariant=False (SDPA attention): its tokens in a batch
    differ from its own tokens alone."""
    lm = load_model(model_dir, dtype="bfloat16")  # its own copy: the flag is set on the model
    cfg = EngineConfig(model_dir, dtype="bfloat16", batch_invariant=False, num_blocks=256)
    variant = LLMEngine(cfg, loaded=lm)
    alone = [variant.generate([p], GREEDY)[0] for p in prompts()]
    assert variant.generate(prompts(), GREEDY) != alone
