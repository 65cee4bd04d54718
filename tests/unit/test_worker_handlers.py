"""The prefill and decode handlers in one process: two engines on the tiny llama, a fake
transport between them. Decode stream (reserve, ticket) -> prefill push -> admit -> tokens ->
release, abort at each stage, the stream leaving before its KV, lease expiry of a bare
reservation, a cancelled reserve; block accounting checked after each (and by the
make_engine fixture at teardown: every block free, integrity holds)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import SimpleNamespace

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.params import SamplingParams
from pdserve.errors import DeadlineError, InvalidRequestError, UnavailableError
from pdserve.worker.decode import DecodeHandler
from pdserve.worker.kv_reuse import KVReuse
from pdserve.worker.prefill import PrefillHandler

from .fake_transport import FakeTransport

PROMPT = list(range(3, 43))  # 40 tokens: 3 blocks of 16 (+1 for token 0 -> 3 blocks)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


class Pair:
    """A prefill handler and a decode handler, each with its own engine."""

    def __init__(self, prefill_llm, decode_llm, lease_s: float = 30.0) -> None:
        self.transport = FakeTransport()
        self.p_engine = AsyncEngine(prefill_llm)
        self.d_engine = AsyncEngine(decode_llm)
        self.prefill = PrefillHandler(
            self.p_engine, self.transport, KVReuse(self.p_engine, self.transport, 1.0), 5.0
        )
        self.decode = DecodeHandler(
            self.d_engine,
            self.transport,
            KVReuse(self.d_engine, self.transport, 1.0),
            "d0",
            lease_s,
        )

    async def reserve(self, rid: str, params=GREEDY, lease_s: float | None = None):
        return await self.decode.reserve(rid, len(PROMPT), lease_s, PROMPT, params)

    async def open(self, rid: str, params=GREEDY, lease_s: float | None = None):
        """A Decode stream and its first message, the ticket."""
        stream = self.decode.decode(rid, PROMPT, params, lease_s)
        return stream, await stream.__anext__()

    @staticmethod
    async def collect(stream, first: int) -> list[int]:
        tokens = [first]  # (the stream sends the tokens after token 0)
        async for ev in stream:
            tokens += ev.token_ids
        return tokens

    async def assert_idle(self) -> None:
        """Both engines: every block free, no reservation, no hold, no stream (exact)."""
        for engine in (self.p_engine, self.d_engine):
            ins = await engine.inspect()
            assert ins.num_free_blocks == ins.num_blocks, ins
            assert (ins.num_reservations, ins.num_held_blocks, ins.num_streams) == (0, 0, 0), ins
            assert ins.num_running == ins.num_waiting == 0, ins
        assert self.decode.num_reserved == 0

    async def close(self) -> None:
        await self.decode.release_all()
        await self.p_engine.shutdown()
        await self.d_engine.shutdown()


@pytest.fixture
async def pair(make_engine):
    p = Pair(make_engine(num_blocks=64), make_engine(num_blocks=64))
    yield p
    await p.close()


async def wait_for(pred, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_reserve_admit_stream_release_matches_one_engine(pair, make_engine):
    ref = make_engine().generate([PROMPT], GREEDY)[0]
    stream, ticket = await pair.open("r1")
    assert ticket.num_blocks == 3
    ins = await pair.d_engine.inspect()
    assert (ins.num_reservations, ins.num_reserved_blocks) == (1, 3)
    assert ins.num_free_blocks == ins.num_blocks - 3
    assert pair.decode.num_reserved == 1
    first, stages = await pair.prefill.prefill("r1", PROMPT, GREEDY, ticket, False)
    assert stages.transfer_bytes > 0
    await wait_for(lambda: pair.decode.counters["admitted"] == 1)  # on arrival of KV + token 0
    ins = await pair.d_engine.inspect()
    assert ins.num_reservations == 0  # the blocks are the sequence's now
    assert await pair.collect(stream, first) == ref
    assert pair.decode.num_reserved == 0
    await pair.assert_idle()


async def test_stream_leaving_before_its_kv_frees_the_reservation(pair):
    """The cancel that lands between reserve and token 0: the stream goes, the blocks and
    receives go with it, and a prefill that pushes later finds no receiver."""
    stream, ticket = await pair.open("s1")
    await stream.aclose()
    await wait_for(lambda: pair.decode.num_reserved == 0)
    await pair.assert_idle()
    with pytest.raises(DeadlineError):
        await pair.prefill.prefill("s1", PROMPT, GREEDY, ticket, False)
    await pair.assert_idle()


async def test_abort_of_an_open_stream_before_its_kv_ends_it(pair):
    stream, _ = await pair.open("s2")
    assert await pair.decode.abort("s2")
    await pair.assert_idle()
    with pytest.raises(UnavailableError):
        await stream.__anext__()
    await pair.assert_idle()


async def test_abort_after_reserve_frees_at_once_and_prefill_fails(pair):
    ticket = await pair.reserve("a1")
    assert await pair.decode.abort("a1")
    await pair.assert_idle()  # freed at once, not at lease expiry
    assert not await pair.decode.abort("a1")  # idempotent
    with pytest.raises(DeadlineError):  # the decode's receives are gone
        await pair.prefill.prefill("a1", PROMPT, GREEDY, ticket, False)
    await pair.assert_idle()


async def test_abort_after_admission_before_decode_call(pair):
    ticket = await pair.reserve("a2", LONG)
    await pair.prefill.prefill("a2", PROMPT, LONG, ticket, False)
    await wait_for(lambda: pair.decode.counters["admitted"] == 1)
    assert await pair.decode.abort("a2")
    await pair.assert_idle()


async def test_decode_call_leaving_mid_stream_stops_the_sequence(pair):
    stream, ticket = await pair.open("a3", LONG)
    await pair.prefill.prefill("a3", PROMPT, LONG, ticket, False)
    got = 0
    async for ev in stream:
        got += len(ev.token_ids)
        if got >= 3:
            break
    await stream.aclose()
    await wait_for(lambda: pair.d_engine.accounting.num_running == 0)
    await pair.assert_idle()


async def test_abort_during_prefill_retires_every_send(pair):
    """Cancel the Prefill call while its layers are being sent: no send task is left
    unawaited ('Task exception was never retrieved'), nothing stays allocated."""
    errors: list[dict] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    pair.transport.send_delay_s = 0.05
    ticket = await pair.reserve("a4")
    task = asyncio.ensure_future(pair.prefill.prefill("a4", PROMPT, GREEDY, ticket, False))
    await wait_for(lambda: pair.p_engine.accounting.num_running == 0 and pair.transport.sends < 2)
    await asyncio.sleep(0.02)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, DeadlineError):
        await task
    assert await pair.decode.abort("a4")
    await asyncio.sleep(0.2)  # any late send settles
    import gc

    gc.collect()
    await asyncio.sleep(0)
    await pair.assert_idle()
    assert not [e for e in errors if "never retrieved" in str(e.get("message", ""))]


async def test_lease_expiry_frees_a_reservation_nobody_used(pair):
    await pair.reserve("e1", lease_s=0.3)
    assert pair.decode.num_live_reservations == 1
    await wait_for(lambda: pair.decode.num_reserved == 0)
    assert pair.decode.counters["leases_expired"] == 1
    await pair.assert_idle()


async def test_lease_expiry_aborts_an_admitted_request_nobody_collected(pair):
    ticket = await pair.reserve("e2", LONG, lease_s=1.0)
    await pair.prefill.prefill("e2", PROMPT, LONG, ticket, False)
    await wait_for(lambda: pair.decode.counters["admitted"] == 1)
    await wait_for(lambda: pair.decode.num_reserved == 0, timeout=5.0)
    await wait_for(lambda: pair.d_engine.accounting.num_running == 0)
    assert pair.decode.counters["leases_expired"] == 1
    await pair.assert_idle()


async def test_a_dead_lease_is_not_live_for_drain(pair, monkeypatch):
    """A lease that ran out counts as dead for a drain at once, even before its expiry timer
    released it. The wall clock is moved past the lease (no sleep racing the timer)."""
    import pdserve.worker.decode as decode_mod

    await pair.reserve("e3", lease_s=30.0)
    assert pair.decode.num_live_reservations == 1
    past_the_lease = time.time() + 31.0
    monkeypatch.setattr(decode_mod, "time", SimpleNamespace(time=lambda: past_the_lease))
    assert pair.decode.num_live_reservations == 0  # a drain does not wait for it
    assert pair.decode.num_reserved == 1  # still held: the timer has not fired
    monkeypatch.undo()
    assert await pair.decode.abort("e3")
    await pair.assert_idle()


async def test_cancelled_reserves_leave_nothing_reserved(pair):
    """Reserve RPCs cancelled while the decode engine is busy: whatever the engine thread
    reserved for them is released (the original leak: 12 cancelled Reserves, 40 blocks)."""
    busy = pair.d_engine.generate("busy", list(range(2, 120)), LONG)
    await busy.__anext__()
    tasks = [asyncio.ensure_future(pair.reserve(f"c{i}")) for i in range(12)]
    await asyncio.sleep(0)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await busy.aclose()
    await wait_for(lambda: pair.d_engine.accounting.num_running == 0)
    await pair.assert_idle()


async def test_abort_while_reserve_is_in_flight(pair):
    busy = pair.d_engine.generate("busy", list(range(2, 120)), LONG)
    await busy.__anext__()
    task = asyncio.ensure_future(pair.reserve("c-abort"))
    await asyncio.sleep(0)
    assert await pair.decode.abort("c-abort")
    with pytest.raises(Exception, match="aborted during Reserve"):
        await task
    await busy.aclose()
    await wait_for(lambda: pair.d_engine.accounting.num_running == 0)
    await pair.assert_idle()


async def test_reserve_requires_the_prompt_and_sampling(pair):
    with pytest.raises(InvalidRequestError) as ei:
        await pair.decode.reserve("v1", len(PROMPT), None, [], GREEDY)
    assert ei.value.field == "prompt_token_ids"
    with pytest.raises(InvalidRequestError) as ei:
        await pair.decode.reserve("v1", len(PROMPT), None, PROMPT, None)
    assert ei.value.field == "sampling"
    await pair.reserve("v1")
    with pytest.raises(InvalidRequestError):
        await pair.reserve("v1")
    await pair.decode.abort("v1")
    await pair.assert_idle()


async def test_an_abort_that_overtakes_its_reserve_refuses_it(pair):
    """The Abort arrives first (nothing known of the id yet); the Reserve that comes later
    is refused instead of holding its blocks until the lease ends. Only once."""
    assert not await pair.decode.abort("late-1")
    with pytest.raises(UnavailableError, match="aborted before its Reserve"):
        await pair.reserve("late-1")
    await pair.assert_idle()
    await pair.reserve("late-1")  # the memory is single use
    assert await pair.decode.abort("late-1")
    await pair.assert_idle()


async def test_a_reserve_refused_for_want_of_blocks_can_be_retried_after_its_abort(pair):
    """The router aborts a refused Reserve and retries the same id later (KvQueue): that
    Abort finds nothing, but the id was seen, so the retry is not taken for a late Reserve."""
    from pdserve.errors import OverloadedError

    huge = list(range(2, 2 + 16 * 80))  # 80 blocks: more than the 64-block pool
    with pytest.raises(OverloadedError):
        await pair.decode.reserve("kvq-1", len(huge), None, huge, GREEDY)
    assert not await pair.decode.abort("kvq-1")
    await pair.reserve("kvq-1")  # the retry (a prompt that fits now)
    assert await pair.decode.abort("kvq-1")
    await pair.assert_idle()
