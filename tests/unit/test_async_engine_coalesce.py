"""A stream whose consumer falls behind the engine gets the queued outputs merged into one
(fewer, larger messages), in order, with nothing lost: the first output always alone, a queued
error raised after the tokens before it, and an early close still aborting the request."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.commands import Abort
from pdserve.engine.outputs import RequestOutput
from pdserve.errors import UnavailableError


def out(tokens: list[int], finished: bool = False, n: int = 0) -> RequestOutput:
    return RequestOutput("r", tokens, finished, "length" if finished else None,
                         num_output_tokens=n)  # fmt: skip


def consume(items: list, take: int | None = None) -> tuple[list[RequestOutput], list, object]:
    """Queue `items` at once (the consumer is behind), then read the stream."""
    posted: list = []
    engine = SimpleNamespace(_post=posted.append)

    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        for it in items:
            queue.put_nowait(it)
        got, err = [], None
        gen = AsyncEngine._outputs(engine, "r", queue)
        try:
            async for o in gen:
                got.append(o)
                if take is not None and len(got) == take:
                    break
        except BaseException as e:
            err = e
        finally:
            await gen.aclose()
        return got, err

    got, err = asyncio.run(go())
    return got, posted, err


def test_queued_outputs_merge_after_the_first():
    items = [out([5], n=1), out([6], n=2), out([7], n=3), out([8], True, n=4)]
    got, posted, err = consume(items)
    assert err is None and posted == []
    assert [o.new_token_ids for o in got] == [[5], [6, 7, 8]]
    last = got[-1]
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 4
    assert items[1].new_token_ids == [6]  # the engine's outputs are not mutated


def test_a_stream_that_keeps_up_is_not_merged():
    async def go():
        queue: asyncio.Queue = asyncio.Queue()
        gen = AsyncEngine._outputs(SimpleNamespace(_post=lambda c: None), "r", queue)
        got = []
        for i in range(3):
            queue.put_nowait(out([i], finished=i == 2))
            got.append(await gen.__anext__())
        return got

    assert [o.new_token_ids for o in asyncio.run(go())] == [[0], [1], [2]]


def test_a_queued_error_comes_after_the_tokens_before_it():
    boom = UnavailableError("engine is shut down")
    got, posted, err = consume([out([1]), out([2]), out([3]), boom, out([9])])
    assert [o.new_token_ids for o in got] == [[1], [2, 3]]
    assert err is boom and posted == []  # the stream ended with its error: no Abort


def test_leaving_early_still_aborts():
    got, posted, err = consume([out([1]), out([2]), out([3])], take=1)
    assert [o.new_token_ids for o in got] == [[1]]
    assert posted == [Abort("r")]
    assert err is None


@pytest.mark.parametrize("n", [2, 17])
def test_every_token_arrives_once_in_order(n):
    items = [out([i], finished=i == n - 1, n=i + 1) for i in range(n)]
    got, _, err = consume(items)
    assert err is None
    assert [t for o in got for t in o.new_token_ids] == list(range(n))
