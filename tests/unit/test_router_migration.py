"""Migration bookkeeping (router/migration.py) with fake attempts: the continuation's prompt,
max_tokens and output offset; a broken stream continues with no token lost or repeated and
the same finish (length or stop) as an uninterrupted run; what does not migrate; the bound."""

from __future__ import annotations

import asyncio
import hashlib

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.params import SamplingParams
from pdserve.errors import DeadlineError, InvalidRequestError, OverloadedError, UnavailableError
from pdserve.router.cluster.registry import ROLE_DECODE, ROLE_PREFILL, Registry
from pdserve.router.cluster.workers import RemoteError
from pdserve.router.job import Chunk, Job
from pdserve.router.lifecycle.migration import Migrator, StreamLost, continuation, fold, migratable
from pdserve.v1 import common_pb2

STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH
STOP_TOKEN = 7


def make_job(prompt=(1, 2, 3), max_tokens=10, seed=5, stop=(STOP_TOKEN,)) -> Job:
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.8, seed=seed, stop_token_ids=tuple(stop)
    )
    return Job(request_id="r1", token_ids=list(prompt), params=params)


def test_continuation_bookkeeping():
    job = make_job(max_tokens=10)
    job.stages.cached_tokens = 2
    c = continuation(job, [40, 41, 42], migration=1)
    assert c.token_ids == [1, 2, 3, 40, 41, 42]
    assert c.params.max_tokens == 7
    assert c.params.output_offset == 3
    # the context needed is unchanged: prompt + max_tokens
    assert len(c.token_ids) + c.params.max_tokens == len(job.token_ids) + job.params.max_tokens
    assert c.params.seed == job.params.seed
    assert c.params.stop_token_ids == (STOP_TOKEN,)
    assert c.request_id == "r1.m1"
    assert c.stages.cached_tokens == 0 and c.decode_instance == ""
    # the original is untouched
    assert job.token_ids == [1, 2, 3] and job.params.max_tokens == 10
    assert job.params.output_offset == 0
    # a second migration counts from the original job
    c2 = continuation(job, [40, 41, 42, 43, 44], migration=2)
    assert c2.params.max_tokens == 5 and c2.params.output_offset == 5
    assert c2.request_id == "r1.m2"
    with pytest.raises(ValueError):
        continuation(job, [], migration=1)
    with pytest.raises(ValueError):
        continuation(job, list(range(10)), migration=1)


def test_fold_adds_work_not_cache_hits():
    job = make_job()
    job.stages.cached_tokens, job.stages.decode_ms = 3, 1.0
    part = continuation(job, [9], 1)
    part.stages.cached_tokens, part.stages.decode_ms, part.stages.prefill_ms = 4, 2.0, 5.0
    part.decode_instance = "d2"
    fold(job, part)
    assert job.stages.cached_tokens == 3
    assert job.stages.decode_ms == 3.0 and job.stages.prefill_ms == 5.0
    assert job.decode_instance == "d2"


@pytest.mark.parametrize(
    "exc, expected",
    [
        (RemoteError(grpc.StatusCode.UNAVAILABLE, "decode d1: socket closed"), True),
        (UnavailableError("decode d1 ended the stream without finishing"), True),
        (DeadlineError("decode d1 sent nothing for 60 s"), True),
        (StreamLost("decode d1 stopped heartbeating"), True),
        (RemoteError(grpc.StatusCode.INVALID_ARGUMENT, "bad"), False),
        (RemoteError(grpc.StatusCode.INTERNAL, "bug"), False),
        (OverloadedError("full"), False),
        (InvalidRequestError("max_tokens", "bad"), False),
        (RuntimeError("?"), False),
    ],
)
def test_what_migrates(exc, expected):
    assert migratable(exc) is expected


# ---------------------------------------------------------------- a fake cluster
def draw(seed: int, context: list[int], index: int) -> int:
    """A position-derived 'sampler': token = f(seed, output index, context)."""
    h = hashlib.blake2b(f"{seed}|{index}|{context[-3:]}".encode(), digest_size=4).digest()
    return 2 + int.from_bytes(h, "little") % 40  # includes STOP_TOKEN sometimes


class FakeWorkers:
    """Attempts that generate like an engine would, and break after `breaks[i]` chunks."""

    def __init__(self, breaks: list[int], error=None) -> None:
        self.breaks = list(breaks)
        self.jobs: list[Job] = []
        self.closed = 0
        self.error = error or (
            lambda: RemoteError(grpc.StatusCode.UNAVAILABLE, "decode: connection reset")
        )

    async def attempt(self, job: Job):
        self.jobs.append(job)
        job.decode_instance = f"d{len(self.jobs)}"
        limit = self.breaks.pop(0) if self.breaks else None
        context = list(job.token_ids)
        try:
            for i in range(job.params.max_tokens):
                if limit is not None and i >= limit:
                    raise self.error()
                tok = draw(job.params.seed, context, job.params.output_offset + i)
                context.append(tok)
                last = i == job.params.max_tokens - 1
                finish = STOP if tok in job.params.stop_token_ids else (LENGTH if last else 0)
                yield Chunk([tok], finish)
                if finish:
                    return
        finally:
            self.closed += 1


def registry_with_instances() -> Registry:
    reg = Registry()
    reg.register("p1", "127.0.0.1:1", ROLE_PREFILL, "fp", 16)
    for i in range(1, 6):
        reg.register(f"d{i}", f"127.0.0.1:{10 + i}", ROLE_DECODE, "fp", 16)
    return reg


async def collect(migrator: Migrator, job: Job) -> tuple[list[int], int]:
    tokens, finish = [], 0
    async for chunk in migrator.run(job):
        tokens += chunk.token_ids
        finish = chunk.finish_reason
    return tokens, finish


def run_fake(job: Job, breaks: list[int], max_migrations=3, **kw):
    workers = FakeWorkers(breaks, **kw)
    reasons: list[str] = []
    reg = registry_with_instances()
    m = Migrator(workers.attempt, reg, max_migrations, wait_s=0.1, on_migration=reasons.append)
    return asyncio.run(collect(m, job)), workers, reasons, reg


@settings(max_examples=60, deadline=None)
@given(
    max_tokens=st.integers(1, 30),
    seed=st.integers(0, 2**32),
    breaks=st.lists(st.integers(1, 8), max_size=3),
)
def test_a_broken_stream_continues_exactly(max_tokens, seed, breaks):
    (ref, ref_finish), *_ = run_fake(make_job(max_tokens=max_tokens, seed=seed), [])
    (got, finish), workers, reasons, _ = run_fake(
        make_job(max_tokens=max_tokens, seed=seed), breaks
    )
    assert got == ref  # no token lost, repeated or different
    assert finish == ref_finish  # LENGTH at the original max_tokens, or STOP at the same token
    emitted, expected_migrations = 0, 0
    for b in breaks:  # attempt i breaks after breaks[i] of the tokens still owed
        if b >= len(ref) - emitted:
            break
        emitted, expected_migrations = emitted + b, expected_migrations + 1
    assert len(reasons) == len(workers.jobs) - 1 == expected_migrations
    assert workers.closed == len(workers.jobs)
    for j in workers.jobs[1:]:  # each continuation: prompt + tokens so far
        k = len(j.token_ids) - 3
        assert j.token_ids[3:] == ref[:k] and j.params.output_offset == k
        assert j.params.max_tokens == max_tokens - k


def test_the_failed_instance_is_marked_suspect_and_the_job_records_the_new_one():
    job = make_job(max_tokens=12, stop=())
    (_tokens, finish), _workers, reasons, reg = run_fake(job, [3])
    assert finish == LENGTH and reasons == ["unavailable"]
    assert reg.get("d1").suspect_since is not None
    assert job.decode_instance == "d2"


def test_bounded_migrations():
    job = make_job(max_tokens=20, stop=())
    with pytest.raises(RemoteError):
        run_fake(job, [2, 2, 2, 2], max_migrations=3)


def test_no_migration_before_the_first_token_or_for_other_errors():
    with pytest.raises(RemoteError):  # the orchestrator's own retries cover this phase
        run_fake(make_job(max_tokens=5, stop=()), [0])
    bad = lambda: RemoteError(grpc.StatusCode.INVALID_ARGUMENT, "no")  # noqa: E731
    with pytest.raises(RemoteError, match="no"):
        run_fake(make_job(max_tokens=5, stop=()), [2], error=bad)


def test_consumer_leaving_early_closes_the_attempt():
    workers = FakeWorkers([])
    m = Migrator(workers.attempt, registry_with_instances())

    async def first_two():
        gen = m.run(make_job(max_tokens=10, stop=()))
        got = [await gen.__anext__(), await gen.__anext__()]
        await gen.aclose()
        return got

    assert len(asyncio.run(first_two())) == 2
    assert workers.closed == 1


def test_waits_for_a_place_then_gives_the_attempt_its_chance():
    reg = Registry()
    reg.register("p1", "127.0.0.1:1", ROLE_PREFILL, "fp", 16)
    reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)
    workers = FakeWorkers([2])
    m = Migrator(workers.attempt, reg, wait_s=5.0)

    async def scenario():
        async def comes_back():
            await asyncio.sleep(0.3)
            reg.register("d9", "127.0.0.1:3", ROLE_DECODE, "fp", 16)

        back = asyncio.ensure_future(comes_back())
        # d1 is marked suspect by the migration: no decode left until d9 registers
        tokens, finish = await collect(m, make_job(max_tokens=6, stop=()))
        await back
        return tokens, finish

    tokens, finish = asyncio.run(scenario())
    assert len(tokens) == 6 and finish == LENGTH and len(workers.jobs) == 2


def test_the_clients_job_records_every_token_once():
    job = make_job(max_tokens=9, stop=())

    workers = FakeWorkers([4])
    original = workers.attempt

    async def attempt(j):  # like Orchestrator._attempt: each attempt records on its job
        async for chunk in original(j):
            j.output_token_ids.extend(chunk.token_ids)
            yield chunk

    m = Migrator(attempt, registry_with_instances(), wait_s=0.1)
    tokens, _finish = asyncio.run(collect(m, job))
    assert job.output_token_ids == tokens and len(tokens) == 9
    assert workers.jobs[1].output_token_ids == tokens[4:]


def test_no_place_within_the_wait_budget_fails_promptly():
    reg = Registry()
    reg.register("p1", "127.0.0.1:1", ROLE_PREFILL, "fp", 16)
    reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)  # the only decode: it breaks
    workers = FakeWorkers([2])
    m = Migrator(workers.attempt, reg, max_migrations=3, wait_s=0.3)
    with pytest.raises(UnavailableError, match="no instance took it over"):
        asyncio.run(collect(m, make_job(max_tokens=6, stop=())))
    assert len(workers.jobs) == 1  # no attempt without a place


def test_registry_lost_means_expired_or_silent_not_suspect_or_deregistered():
    now = [100.0]
    reg = Registry(heartbeat_timeout_s=3.0, suspect_s=1.0, clock=lambda: now[0])
    for iid in ("a", "b", "c", "d"):
        reg.register(iid, f"127.0.0.1:{ord(iid)}", ROLE_DECODE, "fp", 16)
    reg.mark_suspect("a")  # one failed RPC: not lost
    reg.deregister("b")  # graceful: it finishes its streams
    assert not reg.lost("a") and not reg.lost("b") and not reg.lost("c")
    now[0] += 2.0
    reg.heartbeat("c", ROLE_DECODE, "serving", reg.get("c").load)
    now[0] += 2.0  # a, d silent for 4 s > 3 s; c for 2 s
    assert reg.lost("a") and reg.lost("d") and not reg.lost("c")
    assert sorted(reg.expire()) == ["a", "d"]
    assert reg.lost("a") and reg.lost("d")  # gone, and known to have expired
    assert not reg.lost("never-registered")


def test_a_continuation_failing_before_it_streams_does_not_blame_its_decode():
    job = make_job(max_tokens=12, stop=())
    # attempt 1 (d1) breaks after 3 tokens; attempt 2 (d2) fails before streaming (e.g. its
    # prefill); attempt 3 (d3) finishes
    (tokens, finish), workers, reasons, reg = run_fake(job, [3, 0])
    assert finish == LENGTH and len(tokens) == 12 and len(workers.jobs) == 3
    assert reg.get("d1").suspect_since is not None
    assert reg.get("d2").suspect_since is None
    assert reasons == ["unavailable", "unavailable"]


def test_stream_lost_is_its_own_reason():
    job = make_job(max_tokens=8, stop=())
    (_t, finish), _w, reasons, _reg = run_fake(
        job, [2], error=lambda: StreamLost("decode d1 stopped heartbeating mid-stream")
    )
    assert finish == LENGTH and reasons == ["lost"]


# ---------------------------------------------------------------- the relay's watchdog
class SilentCall:
    """A stream that sends `n` messages, then stays open and silent (a SIGSTOPped worker);
    cancel() ends a pending read with CancelledError, as grpc.aio does."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.cancelled = False
        self._pending: asyncio.Future | None = None

    async def read(self):
        if self.cancelled:
            raise asyncio.CancelledError
        if self.n > 0:
            self.n -= 1
            await asyncio.sleep(0)
            return Msg()
        self._pending = asyncio.get_running_loop().create_future()
        return await self._pending

    def cancel(self) -> bool:
        self.cancelled = True
        if self._pending is not None and not self._pending.done():
            self._pending.cancel()
        return True


class Msg:
    token_ids = [5]
    finish_reason = 0


def _relay_setup(now):
    from pdserve.router.lifecycle import orchestrator as orch_mod
    from pdserve.router.lifecycle.orchestrator import Deadlines, Orchestrator

    reg = Registry(heartbeat_timeout_s=3.0, clock=lambda: now[0])
    inst = reg.register("d1", "127.0.0.1:2", ROLE_DECODE, "fp", 16)
    orch = Orchestrator(reg, None, None, Deadlines(decode_idle_s=60.0))
    return orch_mod, orch, inst


def _relay_task(orch, call, inst, job) -> tuple[asyncio.Future, list]:
    """orch._relay of `call` consumed in a task; the chunks it relayed so far."""
    got: list = []

    async def consume():
        async for chunk in orch._relay(call, inst, job, None, "decode"):
            got.append(chunk)

    return asyncio.ensure_future(consume()), got


def test_relay_watchdog_turns_a_silent_lost_stream_into_stream_lost(monkeypatch):
    now = [100.0]
    orch_mod, orch, inst = _relay_setup(now)
    monkeypatch.setattr(orch_mod, "DECODE_WATCH_S", 0.01)
    call = SilentCall(2)
    job = make_job(max_tokens=10, stop=())

    async def scenario():
        task, got = _relay_task(orch, call, inst, job)
        await asyncio.sleep(0.1)
        assert not task.done() and len(got) == 2  # silent, but still heartbeating
        now[0] += 10.0  # no heartbeat for 10 s: lost
        with pytest.raises(StreamLost, match="decode instance d1"):
            await asyncio.wait_for(task, 5)
        assert call.cancelled

    asyncio.run(scenario())


def test_relay_cut_by_the_sweep_before_the_watchdog_ticks_is_stream_lost(monkeypatch):
    """The router's sweep expires a silent instance and closes its channel, which cancels the
    call, possibly before the watchdog's next tick has flagged the stream: still StreamLost
    (migration reason "lost"), not an UNAVAILABLE failure. (A CI run once counted a frozen
    decode's migrations under another reason: this race.)"""
    now = [100.0]
    orch_mod, orch, inst = _relay_setup(now)
    monkeypatch.setattr(orch_mod, "DECODE_WATCH_S", 3600.0)  # the watchdog never ticks here
    call = SilentCall(2)

    async def scenario():
        task, got = _relay_task(orch, call, inst, make_job(max_tokens=10))
        await asyncio.sleep(0.05)
        assert len(got) == 2
        now[0] += 10.0
        assert orch.registry.expire() == ["d1"]  # the sweep: expired ...
        call.cancel()  # ... and its channel dropped, under the relay
        with pytest.raises(StreamLost, match="decode instance d1 stopped heartbeating"):
            await asyncio.wait_for(task, 5)

    asyncio.run(scenario())


def test_relay_cancelled_by_its_consumer_is_not_stream_lost(monkeypatch):
    now = [100.0]
    orch_mod, orch, inst = _relay_setup(now)
    monkeypatch.setattr(orch_mod, "DECODE_WATCH_S", 0.01)
    call = SilentCall(0)

    async def scenario():
        gen = orch._relay(call, inst, make_job(), None, "decode")
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert call.cancelled

    asyncio.run(scenario())


def test_relay_call_cancelled_under_it_is_unavailable_not_a_client_cancel():
    """A dropped instance's channel closes under its calls: grpc.aio ends them with
    CancelledError in a task nobody cancelled. Mid-stream that is an UNAVAILABLE failure
    (the Migrator continues the request), before the first message a retryable RpcError;
    never a CancelledError, which would end the client's request as if it had left."""
    from pdserve.router.cluster.workers import CallLost

    now = [100.0]
    _orch_mod, orch, inst = _relay_setup(now)

    async def relay_until_closed(n_before: int):
        call = SilentCall(n_before)
        call_read = call.read

        async def read():
            msg = await call_read()
            return Msg() if msg is common_pb2.FinishReason else msg

        call.read = read
        task, got = _relay_task(orch, call, inst, make_job(max_tokens=10))
        await asyncio.sleep(0.05)
        call.cancel()  # what channel.close() does to a call on it
        try:
            await asyncio.wait_for(task, 5)
        except BaseException as exc:  # (the test inspects it)
            return exc, len(got)
        return None, len(got)

    exc, n = asyncio.run(relay_until_closed(2))
    assert n == 2 and isinstance(exc, RemoteError), exc
    assert exc.code == grpc.StatusCode.UNAVAILABLE and "left the registry" in str(exc)
    assert orch.registry.get("d1").suspect_since is not None
    exc, n = asyncio.run(relay_until_closed(0))
    assert n == 0 and isinstance(exc, CallLost), exc
