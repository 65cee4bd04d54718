"""Worker.Streams end to end over a real grpc.aio server on 127.0.0.1: the worker's
`StreamMux` serving scripted streams, the router's `WorkerClients` reading them through
`StreamHandle`s. Each stream behaves as its own Decode/Generate call would: ticket first,
tokens in order and each once, the finish with its stages, a failure with its status after
the tokens before it, EOF for a stream that ends without a finish; leaving a stream (cancel)
stops it on the worker, and so does the end of the call (the router's side closed), for every
stream in it; a worker that goes away fails every open stream as lost (UNAVAILABLE)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from pdserve.errors import InvalidRequestError
from pdserve.router.cluster.streams import StreamFailed
from pdserve.router.cluster.workers import CallLost, WorkerClients
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker.domain import StageCosts, Ticket, TokenEvent
from pdserve.worker.streams import StreamMux

TICKET = Ticket(7, "d0", b"ucx", 7 << 16, 1e12, 3, "fp", b"n" * 16)


class Scripted(worker_pb2_grpc.WorkerServicer):
    """Streams whose behaviour the request id names: `tokens-N` (N tokens, then finish),
    `ticket-N` (a ticket, then N tokens), `fail-N` (N tokens, then INVALID_ARGUMENT), `eof-N`
    (N tokens, no finish), `hold` (a ticket, then waits until stopped). `step` gates every
    token so that all streams make one token per "engine step"."""

    def __init__(self) -> None:
        self.step = asyncio.Condition()
        self.steps = 0
        self.stopped: list[str] = []  # streams whose generator was closed before its end
        self.writes = 0
        self.reads: list[worker_pb2.StreamsRequest] = []  # the router's messages

    async def tick(self) -> None:
        async with self.step:
            self.steps += 1
            self.step.notify_all()

    async def _wait_step(self, seen: int) -> int:
        async with self.step:
            await self.step.wait_for(lambda: self.steps > seen)
        return seen + 1

    async def _events(self, rid: str) -> AsyncIterator[Ticket | TokenEvent]:
        kind, _, n = rid.partition("-")
        n = int(n or 0)
        done = False
        try:
            if kind in ("ticket", "hold"):
                yield TICKET
            if kind == "hold":
                await asyncio.Event().wait()
            seen = 0
            for i in range(n):
                seen = await self._wait_step(seen)
                yield TokenEvent([100 + i])
            if kind == "fail":
                raise InvalidRequestError("prompt", "scripted failure")
            if kind in ("tokens", "ticket"):
                yield TokenEvent([], "length", StageCosts(decode_ms=1.5))
            done = True
        finally:
            if not done:
                self.stopped.append(rid)

    def _open(self, o: worker_pb2.StreamOpen):
        return self._events(o.generate.request_id or o.decode.request_id)

    async def Streams(self, request_iterator, context) -> None:
        await StreamMux(self._open).serve(_Counted(context, self))


class _Counted:
    """The call's context, counting the worker's writes (messages)."""

    def __init__(self, context, worker: Scripted) -> None:
        self._context, self._worker = context, worker

    async def read(self):
        msg = await self._context.read()
        if msg is not grpc.aio.EOF:
            self._worker.reads.append(msg)
        return msg

    async def write(self, msg) -> None:
        self._worker.writes += 1
        await self._context.write(msg)


async def _serve() -> tuple[grpc.aio.Server, Scripted, str]:
    servicer = Scripted()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, servicer, f"127.0.0.1:{port}"


def _generate(rid: str) -> worker_pb2.WorkerGenerateRequest:
    return worker_pb2.WorkerGenerateRequest(request_id=rid, token_ids=[1])


async def _drain(handle) -> tuple[list[int], int, object]:
    tokens: list[int] = []
    while True:
        msg = await handle.read()
        if msg is grpc.aio.EOF:
            return tokens, 0, msg
        tokens += msg.token_ids
        if msg.finish_reason:
            return tokens, msg.finish_reason, msg.stages


async def _until(pred, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():  # noqa: ASYNC110 (polls the scripted worker)
            await asyncio.sleep(0.005)


def test_many_streams_share_one_call_and_one_message_per_step():
    async def scenario():
        server, worker, addr = await _serve()
        workers = WorkerClients(grpc.aio.insecure_channel)
        try:
            handles = [workers.open_generate(addr, _generate(f"tokens-{k}")) for k in range(4)]
            handles += [workers.open_generate(addr, _generate("tokens-5")) for _ in range(60)]
            readers = [asyncio.ensure_future(_drain(h)) for h in handles]
            for _ in range(6):
                await asyncio.sleep(0.05)  # every stream waits for the step
                await worker.tick()
            results = await asyncio.wait_for(asyncio.gather(*readers), 10)
            return results, worker.writes
        finally:
            await workers.close()
            await server.stop(None)

    results, writes = asyncio.run(scenario())
    for k, (tokens, finish, stages) in enumerate(results):
        n = k if k < 4 else 5
        assert tokens == [100 + i for i in range(n)]
        assert finish == common_pb2.FINISH_REASON_LENGTH and stages.decode_ms == 1.5
    # 64 streams, 6 steps: one message per step (plus a few for the finishes), not per token
    assert writes <= 12, writes


def test_ticket_first_then_tokens_and_a_late_reader_gets_them_merged():
    async def scenario():
        server, worker, addr = await _serve()
        workers = WorkerClients(grpc.aio.insecure_channel)
        try:
            handle = workers.open_decode(
                addr, worker_pb2.DecodeRequest(request_id="ticket-3", prompt_token_ids=[1])
            )
            first = await asyncio.wait_for(handle.read(), 5)
            for _ in range(3):
                await worker.tick()
                await asyncio.sleep(0.05)  # nobody reads: the tokens queue in the handle
            return first, await asyncio.wait_for(handle.read(), 5)
        finally:
            await workers.close()
            await server.stop(None)

    first, rest = asyncio.run(scenario())
    assert first.ticket is not None and first.ticket.tag_base == 7 << 16 and not first.token_ids
    assert rest.token_ids == [100, 101, 102] and rest.finish_reason  # one read, merged


def test_a_failure_comes_after_its_tokens_and_eof_ends_an_unfinished_stream():
    async def scenario():
        server, worker, addr = await _serve()
        workers = WorkerClients(grpc.aio.insecure_channel)
        try:
            failing = workers.open_generate(addr, _generate("fail-2"))
            ending = workers.open_generate(addr, _generate("eof-1"))
            for _ in range(2):
                await asyncio.sleep(0.05)
                await worker.tick()
            got = (await failing.read()).token_ids
            with pytest.raises(StreamFailed) as err:
                while True:
                    got += (await failing.read()).token_ids
            return got, err.value, await _drain(ending)
        finally:
            await workers.close()
            await server.stop(None)

    got, err, (tokens, finish, eof) = asyncio.run(scenario())
    assert got == [100, 101]
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "scripted failure" in err.details()
    assert tokens == [100] and finish == 0 and eof is grpc.aio.EOF


def test_cancel_stops_the_stream_on_the_worker_and_ends_a_pending_read():
    async def scenario():
        server, worker, addr = await _serve()
        workers = WorkerClients(grpc.aio.insecure_channel)
        try:
            held = workers.open_decode(addr, worker_pb2.DecodeRequest(request_id="hold"))
            other = workers.open_decode(addr, worker_pb2.DecodeRequest(request_id="ticket-1"))
            assert (await held.read()).ticket is not None
            assert (await other.read()).ticket is not None
            pending = asyncio.ensure_future(held.read())
            await asyncio.sleep(0.02)
            assert held.cancel() and not held.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            await _until(lambda: worker.stopped == ["hold"])
            await worker.tick()  # the other stream goes on
            return await _drain(other)
        finally:
            await workers.close()
            await server.stop(None)

    tokens, finish, _ = asyncio.run(scenario())
    assert tokens == [100] and finish


def test_the_end_of_the_call_stops_every_stream_on_the_worker():
    """The router died or closed its channel: the worker stops (and so frees) every stream
    of that call at once, not at lease expiry."""

    async def scenario():
        server, worker, addr = await _serve()
        try:
            channel = grpc.aio.insecure_channel(addr)
            workers = WorkerClients(lambda _a: channel)
            handles = [
                workers.open_decode(addr, worker_pb2.DecodeRequest(request_id="hold"))
                for _ in range(5)
            ]
            for h in handles:
                assert (await h.read()).ticket is not None
            await channel.close()  # no cancel of any stream: the connection goes away
            await _until(lambda: len(worker.stopped) == 5)
            with pytest.raises(CallLost):
                await handles[0].read()
            await workers.close()
        finally:
            await server.stop(None)

    asyncio.run(scenario())


def test_a_worker_that_goes_away_fails_its_streams_as_lost_and_a_new_call_follows():
    async def scenario():
        server, worker, addr = await _serve()
        workers = WorkerClients(grpc.aio.insecure_channel)
        try:
            handle = workers.open_decode(addr, worker_pb2.DecodeRequest(request_id="hold"))
            assert (await handle.read()).ticket is not None
            await server.stop(None)  # the worker process dies
            with pytest.raises(CallLost) as err:
                await asyncio.wait_for(handle.read(), 5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            server2 = grpc.aio.server()
            worker_pb2_grpc.add_WorkerServicer_to_server(worker, server2)
            server2.add_insecure_port(addr)
            await server2.start()  # restarted on the same address
            try:
                again = workers.open_generate(addr, _generate("tokens-1"))
                reader = asyncio.ensure_future(_drain(again))
                await asyncio.sleep(0.1)
                await worker.tick()
                return await asyncio.wait_for(reader, 10)
            finally:
                await server2.stop(None)
        finally:
            await workers.close()

    tokens, finish, _ = asyncio.run(scenario())
    assert tokens == [100] and finish


def test_without_credit_the_worker_holds_its_events_and_merges_them():
    """A router that falls behind grants no credit: the worker keeps writing nothing and
    merges each stream's tokens, then sends them all in one message for one credit."""

    async def scenario():
        server, worker, addr = await _serve()
        channel = grpc.aio.insecure_channel(addr)
        try:
            call = worker_pb2_grpc.WorkerStub(channel).Streams()
            opens = [worker_pb2.StreamOpen(stream_id=k, generate=_generate("tokens-3"))
                     for k in (1, 2)]  # fmt: skip
            await call.write(worker_pb2.StreamsRequest(open=opens, credit=1))
            await worker.tick()
            first = await asyncio.wait_for(call.read(), 5)  # step 1: one message, the credit
            for _ in range(2):
                await worker.tick()  # steps 2 and 3, the finish: held, no credit
            await asyncio.sleep(0.2)
            writes = worker.writes
            await call.write(worker_pb2.StreamsRequest(credit=1))
            rest = await asyncio.wait_for(call.read(), 5)
            call.cancel()
            return first, writes, rest
        finally:
            await channel.close()
            await server.stop(None)

    first, writes, rest = asyncio.run(scenario())
    assert sorted((e.stream_id, list(e.token_ids)) for e in first.events) == [
        (1, [100]), (2, [100])
    ]  # fmt: skip
    assert writes == 1  # nothing was sent without a credit
    by_stream = {e.stream_id: e for e in rest.events}
    assert len(rest.events) == 2  # one event per stream: its tokens merged, with its finish
    for e in by_stream.values():
        assert list(e.token_ids) == [101, 102] and e.finish_reason


def test_short_streams_carry_their_credit_with_their_opens():
    """One stream after another, each one message from the worker (a short request): every
    grant rides on the next open, so the router writes one message per stream and no
    credit-only messages, and the worker never runs out of credit."""

    async def scenario():
        server, worker, addr = await _serve()
        workers = WorkerClients(grpc.aio.insecure_channel)
        try:
            for _ in range(20):
                handle = workers.open_generate(addr, _generate("tokens-0"))
                tokens, finish, _stages = await asyncio.wait_for(_drain(handle), 5)
                assert tokens == [] and finish == common_pb2.FINISH_REASON_LENGTH
                await asyncio.sleep(0.01)  # the grant is due before the next open
            return worker.reads
        finally:
            await workers.close()
            await server.stop(None)

    reads = asyncio.run(scenario())
    assert [len(m.open) for m in reads] == [1] * 20  # no message without an open
    granted = sum(m.credit for m in reads)
    assert granted >= 20  # the first message's credit, and then every message taken back
