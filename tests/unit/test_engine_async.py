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
    assert aengine.step_ms_ewma > 0  # reported in the worker's LoadReport


async def test_abort_mid_stream(aengine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    got = []
    async for out in aengine.generate("a", [5, 6, 7], params):
        got.append(out)
        if len(got) == 3:
            assert await aengine.abort("a")
    assert got[-1].finished and got[-1].finish_reason == "abort"
    assert not await aengine.abort("a")  # idempotent
    ins = await aengine.inspect()
    assert ins.num_running + ins.num_waiting == 0 and ins.num_free_blocks == ins.num_blocks


async def test_breaking_out_aborts(aengine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    gen = aengine.generate("b", [5, 6, 7], params)
    async for _ in gen:
        break
    await gen.aclose()
    ins = await aengine.inspect()
    assert ins.num_running + ins.num_waiting == 0 and ins.num_streams == 0


async def test_validation_error_crosses(aengine):
    with pytest.raises(InvalidRequestError) as ei:
        await collect(aengine, "bad", [])
    assert ei.value.field == "prompt"
    assert (await aengine.inspect()).num_streams == 0  # the engine thread carries on


async def test_cancelled_reserve_frees_what_the_engine_allocated(aengine):
    """The engine thread allocates while the caller is cancelled: the reservation (registered
    under its request id) is released, never lost (the original leak of a cancelled Reserve)."""
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    busy = aengine.generate("busy", list(range(2, 200)), params)  # keeps the engine stepping
    await busy.__anext__()
    tasks = [asyncio.ensure_future(aengine.reserve(f"r{i}", 40)) for i in range(12)]
    await asyncio.sleep(0)  # every Reserve queued
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await busy.aclose()
    ins = await aengine.inspect()
    assert ins.num_reservations == 0 and ins.num_reserved_blocks == 0
    assert ins.num_free_blocks == ins.num_blocks


async def test_named_commands_keep_block_accounting(aengine):
    blocks = await aengine.reserve("d", 40)
    assert len(blocks) == 3
    ins = await aengine.inspect()
    assert (ins.num_reservations, ins.num_reserved_blocks) == (1, 3)
    assert ins.num_free_blocks == ins.num_blocks - 3
    assert await aengine.abort("d")  # abort frees a pending reservation
    assert await aengine.release("d") == 0  # idempotent
    ins = await aengine.inspect()
    assert ins.num_reservations == 0 and ins.num_free_blocks == ins.num_blocks
