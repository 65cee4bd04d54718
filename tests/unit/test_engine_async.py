"""AsyncEngine: streaming from asyncio, abort, call, shutdown."""

import asyncio

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture
async def aengine(make_engine):
    ae = AsyncEngine(make_engine())
    yield ae
    await ae.shutdown()


async def collect(ae, rid, prompt, params=GREEDY):
    toks, last = [], None
    async for out in ae.generate(rid, prompt, params):
        toks += out.new_token_ids
        last = out
    return toks, last


async def test_concurrent_streams_match_sync(aengine, make_engine):
    prompts = [list(range(2, 2 + n)) for n in (3, 20, 40)]
    ref = [make_engine().generate([p], GREEDY)[0] for p in prompts]
    results = await asyncio.gather(*(collect(aengine, str(i), p) for i, p in enumerate(prompts)))
    assert [r[0] for r in results] == ref
    assert all(r[1].finished and r[1].finish_reason == "length" for r in results)


async def test_abort_mid_stream(aengine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    got = []
    async for out in aengine.generate("a", [5, 6, 7], params):
        got.append(out)
        if len(got) == 3:
            assert await aengine.abort("a")
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert not await aengine.abort("a")  # idempotent
    assert await aengine.call(lambda: aengine.engine.has_unfinished_requests()) is False


async def test_breaking_out_aborts(aengine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    gen = aengine.generate("b", [5, 6, 7], params)
    async for _ in gen:
        break
    await gen.aclose()
    assert await aengine.call(lambda: aengine.engine.num_running + aengine.engine.num_waiting) == 0


async def test_validation_error_crosses(aengine):
    with pytest.raises(InvalidRequestError) as ei:
        await collect(aengine, "bad", [])
    assert ei.value.field == "prompt"
    assert await aengine.call(lambda: 41 + 1) == 42
