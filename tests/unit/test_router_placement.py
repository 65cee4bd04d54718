"""The request owner (RequestPlacement) and the orchestrator's request path with in-process
fake workers: every way a request ends leaves no router charge and no reservation on a
decode, and only instances still holding the request are aborted."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from pdserve.engine.params import SamplingParams
from pdserve.errors import UnavailableError
from pdserve.router.cluster.registry import ROLE_COLOCATED, ROLE_DECODE, ROLE_PREFILL, Registry
from pdserve.router.cluster.streams import StreamChunk
from pdserve.router.cluster.workers import Aborter, stages_from_proto, ticket_from_proto
from pdserve.router.lifecycle.orchestrator import Deadlines, Job, Orchestrator
from pdserve.router.lifecycle.placement import RequestPlacement
from pdserve.router.scheduling.factory import make_policy
from pdserve.v1 import common_pb2, worker_pb2

FIRST, REST = 11, [12, 13, 14]


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"fake {self._code.name}"


class UnaryCall:
    """Like grpc.aio.UnaryUnaryCall: awaitable and cancellable."""

    def __init__(self, coro) -> None:
        self._task = asyncio.ensure_future(coro)

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> bool:
        return self._task.cancel()


class StreamCall:
    """Like grpc.aio.UnaryStreamCall: read() until grpc.aio.EOF; cancel() ends a pending
    read with CancelledError."""

    def __init__(self, agen) -> None:
        self._agen, self.cancelled = agen, False
        self._reading: asyncio.Task | None = None

    async def read(self):
        if self.cancelled:
            raise asyncio.CancelledError
        self._reading = asyncio.ensure_future(anext(self._agen))
        try:
            return await self._reading
        except StopAsyncIteration:
            return grpc.aio.EOF

    def cancel(self) -> bool:
        self.cancelled = True
        if self._reading is not None:
            self._reading.cancel()
        return True


class ChunkCall(StreamCall):
    """A stream of the router's Streams call (cluster/streams.py): reads StreamChunks."""

    async def read(self):
        msg = await super().read()
        if msg is grpc.aio.EOF:
            return msg
        return StreamChunk(
            list(msg.token_ids),
            msg.finish_reason,
            stages_from_proto(msg.stages),
            ticket_from_proto(msg.ticket) if msg.HasField("ticket") else None,
        )


class FakeWorker:
    """One worker's RPCs. A decode "allocates" when its Decode stream opens, before the ticket (as the real
    one does), frees on Abort or when its stream finishes; `reserved` is what it holds."""

    def __init__(self, iid: str) -> None:
        self.iid = iid
        self.calls: list[str] = []
        self.reserved: set[str] = set()
        self.gate: dict[str, asyncio.Event] = {}  # method -> wait for it before answering
        self.fail: dict[str, grpc.StatusCode] = {}
        self.cancel: set[str] = set()  # methods whose call ends cancelled (channel closed)
        self.prefills: list[worker_pb2.PrefillRequest] = []
        self.empty: set[str] = set()  # stream methods that end before their first message
        self.jitter: random.Random | None = None  # random sleeps (0-2 ms) at every step
        self.mid_waiting = False  # a Decode stream waits at its "Decode.mid" gate

    async def _pause(self) -> None:
        if self.jitter is not None:
            await asyncio.sleep(self.jitter.random() * 0.002)

    async def _enter(self, method: str) -> None:
        self.calls.append(method)
        await self._pause()
        if method in self.gate:
            await self.gate[method].wait()
        if method in self.fail:
            raise FakeRpcError(self.fail[method])
        if method in self.cancel:
            raise asyncio.CancelledError  # as grpc.aio ends a call whose channel closed

    def Prefill(self, req, timeout=None, metadata=None):
        self.prefills.append(req)

        async def go():
            await self._enter("Prefill")
            return worker_pb2.PrefillResponse(first_token_id=FIRST)

        return UnaryCall(go())

    def Decode(self, req, metadata=None):
        """The reservation (gates/failures keyed "Decode" apply before the ticket), the
        ticket, then the tokens after token 0 ("Decode.mid" gates the second one)."""

        async def go():
            self.reserved.add(req.request_id)
            try:
                await self._enter("Decode")
            except FakeRpcError as err:
                if err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self.reserved.discard(req.request_id)  # a refusal holds nothing
                raise
            yield worker_pb2.TokenChunk(
                ticket=worker_pb2.Ticket(ticket_id=7, decode_instance_id=self.iid)
            )
            for i, tok in enumerate(REST):
                if i == 1 and "Decode.mid" in self.gate:
                    self.mid_waiting = True
                    await self.gate["Decode.mid"].wait()
                await self._pause()
                last = i == len(REST) - 1
                if last:
                    self.reserved.discard(req.request_id)
                yield worker_pb2.TokenChunk(
                    token_ids=[tok],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                )

        return ChunkCall(go())

    def Generate(self, req, metadata=None):
        async def go():
            await self._enter("Generate")
            if "Generate" in self.empty:
                return
            for tok in [FIRST, *REST]:
                yield worker_pb2.TokenChunk(
                    token_ids=[tok],
                    finish_reason=common_pb2.FINISH_REASON_LENGTH if tok == REST[-1] else 0,
                )

        return ChunkCall(go())

    async def Abort(self, req, timeout=None, metadata=None):
        self.calls.append("Abort")
        self.reserved.discard(req.request_id)
        return worker_pb2.AbortResponse(found=True)


class FakeWorkers:
    def __init__(self) -> None:
        self.by_address: dict[str, FakeWorker] = {}

    def add(self, registry: Registry, iid: str, role: int) -> FakeWorker:
        registry.register(iid, f"{iid}:1", role, "fp", 16)
        worker = self.by_address[f"{iid}:1"] = FakeWorker(iid)
        return worker

    def stub(self, address: str) -> FakeWorker:
        return self.by_address[address]

    def open_decode(self, address: str, req) -> ChunkCall:
        return self.by_address[address].Decode(req)

    def open_generate(self, address: str, req) -> ChunkCall:
        return self.by_address[address].Generate(req)


class Cluster:
    def __init__(self, prefills=("p0",), decodes=("d0",), colocated=()) -> None:
        self.registry = Registry(heartbeat_timeout_s=60.0)
        self.workers = FakeWorkers()
        self.w = {}
        for iid in prefills:
            self.w[iid] = self.workers.add(self.registry, iid, ROLE_PREFILL)
        for iid in decodes:
            self.w[iid] = self.workers.add(self.registry, iid, ROLE_DECODE)
        for iid in colocated:
            self.w[iid] = self.workers.add(self.registry, iid, ROLE_COLOCATED)
        self.orch = Orchestrator(
            self.registry,
            make_policy("round_robin", False),
            self.workers,
            Deadlines(),
            max_prefill_attempts=3,
        )

    def job(self, rid: str = "r1") -> Job:
        return Job(
            request_id=rid,
            token_ids=list(range(1, 40)),
            params=SamplingParams(max_tokens=8),
        )

    def charges(self) -> dict[str, tuple[int, int]]:
        return {
            i.instance_id: (i.inflight_requests, i.inflight_tokens)
            for i in self.registry.instances()
            if i.inflight_requests or i.inflight_tokens
        }

    def reserved(self) -> dict[str, set[str]]:
        return {iid: w.reserved for iid, w in self.w.items() if w.reserved}


async def collect(orch: Orchestrator, job: Job, out: list[int]) -> None:
    async for chunk in orch.run(job):
        out.extend(chunk.token_ids)


async def until(pred, timeout: float = 2.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():  # noqa: ASYNC110 (polls fake-worker state)
            await asyncio.sleep(0.001)


async def cancel_when(c: Cluster, pred) -> list[int]:
    out: list[int] = []
    task = asyncio.create_task(collect(c.orch, c.job(), out))
    await until(pred)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await c.orch.close()
    return out


# ------------------------------------------------------------------ orchestrator


async def test_finished_request_is_released_without_aborts():
    c = Cluster()
    out: list[int] = []
    await collect(c.orch, c.job(), out)
    await c.orch.close()
    assert out == [FIRST, *REST]
    assert c.w["d0"].calls == ["Decode"]
    assert c.w["p0"].calls == ["Prefill"]
    assert c.charges() == {} and c.reserved() == {}


async def test_charges_while_prefilling():
    c = Cluster()
    c.w["p0"].gate["Prefill"] = gate = asyncio.Event()
    out: list[int] = []
    task = asyncio.create_task(collect(c.orch, c.job(), out))
    await until(lambda: "Prefill" in c.w["p0"].calls)
    assert c.charges() == {"p0": (1, 39), "d0": (1, 0)}
    gate.set()
    await task
    assert c.charges() == {}


async def test_cancel_before_the_ticket_aborts_the_decode():
    # The decode allocated, but the router never saw the ticket.
    c = Cluster()
    c.w["d0"].gate["Decode"] = asyncio.Event()
    await cancel_when(c, lambda: "Decode" in c.w["d0"].calls)
    assert c.w["d0"].calls == ["Decode", "Abort"]
    assert c.w["p0"].calls == []
    assert c.charges() == {} and c.reserved() == {}


async def test_cancel_during_prefill_aborts_prefill_and_decode():
    c = Cluster()
    c.w["p0"].gate["Prefill"] = asyncio.Event()
    await cancel_when(c, lambda: "Prefill" in c.w["p0"].calls)
    assert c.w["p0"].calls == ["Prefill", "Abort"]
    assert c.w["d0"].calls == ["Decode", "Abort"]
    assert c.charges() == {} and c.reserved() == {}


async def test_cancel_mid_stream_aborts_only_the_decode():
    c = Cluster()
    c.w["d0"].gate["Decode.mid"] = asyncio.Event()
    out = await cancel_when(c, lambda: c.w["d0"].mid_waiting)
    assert out[:1] == [FIRST]
    assert c.w["p0"].calls == ["Prefill"]  # it had finished: nothing to abort
    assert c.w["d0"].calls == ["Decode", "Abort"]
    assert c.charges() == {} and c.reserved() == {}


async def test_consumer_closing_after_first_token_aborts_the_decode():
    c = Cluster()
    gen = c.orch.run(c.job())
    assert (await anext(gen)).token_ids == [FIRST]
    await gen.aclose()  # e.g. a stop string matched
    await c.orch.close()
    assert c.w["d0"].calls == ["Decode", "Abort"]
    assert c.charges() == {} and c.reserved() == {}


async def test_prefill_failure_releases_decode_before_retrying_elsewhere():
    c = Cluster(prefills=("p0", "p1"))
    c.w["p0"].fail["Prefill"] = grpc.StatusCode.UNAVAILABLE
    job = c.job()
    out: list[int] = []
    await collect(c.orch, job, out)
    await c.orch.close()
    assert out == [FIRST, *REST]
    assert job.prefill_attempts == 2 and job.prefill_instance == "p1"
    # the first ticket is aborted (awaited) before the decode is asked again
    assert c.w["d0"].calls == ["Decode", "Abort", "Decode"]
    assert c.w["p0"].calls == ["Prefill", "Abort"]
    assert c.registry.get("p0").suspect_since is not None
    assert c.charges() == {} and c.reserved() == {}


async def test_non_retryable_prefill_failure_raises_and_releases():
    c = Cluster(prefills=("p0", "p1"))
    c.w["p0"].fail["Prefill"] = grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(Exception, match="fake INVALID_ARGUMENT"):
        await collect(c.orch, c.job(), [])
    await c.orch.close()
    assert c.w["p1"].calls == []
    assert c.charges() == {} and c.reserved() == {}


async def test_full_decode_is_skipped_for_another():
    c = Cluster(decodes=("d0", "d1"))
    c.w["d0"].fail["Decode"] = grpc.StatusCode.RESOURCE_EXHAUSTED
    job = c.job()
    await collect(c.orch, job, [])
    await c.orch.close()
    assert job.decode_instance == "d1"
    assert c.w["d0"].calls == ["Decode"]  # it refused: it holds nothing, so no Abort
    assert c.charges() == {} and c.reserved() == {}


async def test_a_refused_reserve_does_not_wake_the_other_capacity_waiters():
    # Two requests wait for the one (full) decode. A refusal frees no room: if its release
    # woke the other waiter, the two would retry each other's refusals back to back (a
    # retry storm of Decode calls) instead of once per change or `recheck_s` (0.25 s).
    c = Cluster(decodes=("d0",))
    c.orch.deadlines = Deadlines(kv_queue_s=0.6)
    c.w["d0"].fail["Decode"] = grpc.StatusCode.RESOURCE_EXHAUSTED
    jobs = [c.job("r1"), c.job("r2")]
    results = await asyncio.gather(*(collect(c.orch, j, []) for j in jobs), return_exceptions=True)
    await c.orch.close()
    assert all("RESOURCE_EXHAUSTED" in str(r) or "KV" in str(r) for r in results), results
    # each request: a first try, then one per 0.25 s recheck within 0.6 s
    assert 2 <= c.w["d0"].calls.count("Decode") <= 10, len(c.w["d0"].calls)
    assert c.charges() == {} and c.reserved() == {}


def test_a_refused_holding_leaves_without_abort_or_wake_up():
    c, _aborter, pl = _placement()
    d0 = c.registry.get("d0")
    woken: list[int] = []
    c.registry.on_change(lambda: woken.append(1))
    pl.charge(d0, requests=1)
    pl.leave(d0, refused=True)
    assert woken == [] and c.charges() == {}
    pl.charge(d0, requests=1)
    pl.leave(d0, abort=False)  # a real release: room may have freed
    assert woken == [1]


async def test_colocated_failure_before_first_chunk_retries():
    c = Cluster(prefills=(), decodes=(), colocated=("c0", "c1"))
    c.w["c0"].fail["Generate"] = grpc.StatusCode.UNAVAILABLE
    job = c.job()
    out: list[int] = []
    await collect(c.orch, job, out)
    await c.orch.close()
    assert out == [FIRST, *REST] and job.decode_instance == "c1"
    assert c.w["c0"].calls == ["Generate", "Abort"]
    assert c.w["c1"].calls == ["Generate"]
    assert c.charges() == {}


async def test_cancel_storm_leaves_nothing_held():
    # 300 requests, 16-32 in flight, each cancelled at a random moment (before the ticket,
    # Prefill, the first token or the stream) or left to finish; prefill failures and full
    # decodes mixed in. Afterwards no decode holds a reservation and no charge is left.
    rng = random.Random(8)
    c = Cluster(prefills=("p0", "p1"), decodes=("d0", "d1"))
    for w in c.w.values():
        w.jitter = rng
    done = cancelled = 0

    async def one(i: int) -> None:
        nonlocal done, cancelled
        c.w["p1"].fail = {"Prefill": grpc.StatusCode.UNAVAILABLE} if i % 7 == 0 else {}
        c.w["d1"].fail = {"Decode": grpc.StatusCode.RESOURCE_EXHAUSTED} if i % 5 == 0 else {}
        c.registry.get("p1").suspect_since = None
        task = asyncio.create_task(collect(c.orch, c.job(f"r{i}"), []))
        limit = None if rng.random() < 0.3 else rng.random() * 0.02  # None: let it finish
        await asyncio.wait({task}, timeout=limit)
        if task.done():
            done += task.exception() is None
        else:
            task.cancel()
            cancelled += 1
        await asyncio.gather(task, return_exceptions=True)

    sem = asyncio.Semaphore(rng.randint(16, 32))

    async def bounded(i: int) -> None:
        async with sem:
            await one(i)

    await asyncio.gather(*(bounded(i) for i in range(300)))
    await c.orch.close()
    assert done > 30 and cancelled > 30  # both outcomes were exercised
    assert c.reserved() == {}
    assert c.charges() == {}


async def test_no_instances_is_unavailable():
    c = Cluster(prefills=(), decodes=())
    with pytest.raises(UnavailableError, match="no decode"):
        await collect(c.orch, c.job(), [])


# ------------------------------------------------------------------ RequestPlacement


def _placement():
    c = Cluster(prefills=("p0",), decodes=("d0",))
    aborter = Aborter(c.workers, timeout_s=1.0)
    return c, aborter, RequestPlacement("r1", c.registry, aborter)


async def test_close_releases_each_holding_once():
    c, aborter, pl = _placement()
    p0, d0 = c.registry.get("p0"), c.registry.get("d0")
    pl.charge(d0, requests=1)  # picked
    pl.reserved(d0, ticket_from_proto(worker_pb2.Ticket(ticket_id=3)))
    pl.charge(p0, requests=1, tokens=10)
    assert pl.holding() == ["d0", "p0"] and pl.ticket.ticket_id == 3
    pl.leave(p0, abort=False)
    pl.leave(p0)  # already left: nothing
    pl.close()
    pl.close()
    await aborter.wait()
    assert c.w["p0"].calls == []
    assert c.w["d0"].calls == ["Abort"]
    assert c.charges() == {} and pl.decode is None and pl.ticket is None
    with pytest.raises(RuntimeError, match="closed"):
        pl.expect(d0)


def test_reserved_needs_the_charge_taken_at_pick():
    c, _aborter, pl = _placement()
    d0 = c.registry.get("d0")
    with pytest.raises(RuntimeError, match="not charged"):
        pl.reserved(d0, ticket_from_proto(worker_pb2.Ticket(ticket_id=1)))


async def test_a_burst_spreads_over_the_decodes():
    """Concurrent requests pick their decode before any ticket comes: each pick must
    see the earlier ones (the charge is taken at pick time), so a burst does not all land
    on the decode that looked idle."""
    c = Cluster(decodes=("d0", "d1"))
    c.orch.policy = make_policy("least_loaded", False)
    for d in ("d0", "d1"):
        c.w[d].gate["Decode"] = asyncio.Event()  # every ticket waits until all picked
    jobs = [c.job(f"r{i}") for i in range(8)]
    tasks = [asyncio.create_task(collect(c.orch, j, [])) for j in jobs]
    await until(lambda: len(c.w["d0"].calls) + len(c.w["d1"].calls) == 8)
    assert (c.w["d0"].calls, c.w["d1"].calls) == (["Decode"] * 4, ["Decode"] * 4)
    for d in ("d0", "d1"):
        c.w[d].gate["Decode"].set()
    await asyncio.gather(*tasks)
    await c.orch.close()
    assert sorted(j.decode_instance for j in jobs) == ["d0"] * 4 + ["d1"] * 4
    assert c.charges() == {} and c.reserved() == {}


async def test_leave_now_cancelled_still_sends_the_abort():
    c, aborter, pl = _placement()
    d0 = c.registry.get("d0")
    pl.charge(d0, requests=1)
    pl.reserved(d0, ticket_from_proto(worker_pb2.Ticket(ticket_id=3)))
    c.w["d0"].gate["Abort"] = gate = asyncio.Event()
    slow = c.w["d0"].Abort

    async def gated_abort(req, timeout=None, metadata=None):
        await gate.wait()
        return await slow(req)

    c.w["d0"].Abort = gated_abort
    task = asyncio.create_task(pl.leave_now(d0))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    await aborter.wait()
    assert c.w["d0"].calls == ["Abort"]  # the background retry of the cancelled one
    assert c.charges() == {} and not pl.holds("d0")


async def test_a_reserve_cancelled_by_a_channel_close_goes_to_another_decode():
    """The router closes the channel of an instance that expired; a Decode stream waiting for its ticket on it
    ends cancelled. That is the instance's failure (retry elsewhere), not the client's
    cancel."""
    c = Cluster(decodes=("d0", "d1"))
    c.w["d0"].cancel.add("Decode")
    out: list[int] = []
    job = c.job()
    await collect(c.orch, job, out)
    await c.orch.close()
    assert out == [FIRST, *REST] and job.decode_instance == "d1"
    assert c.registry.get("d0").suspect_since is not None
    assert c.charges() == {} and c.reserved() == {}


async def test_a_prefill_cancelled_by_a_channel_close_goes_to_another_prefill():
    c = Cluster(prefills=("p0", "p1"))
    c.w["p0"].cancel.add("Prefill")
    out: list[int] = []
    job = c.job()
    await collect(c.orch, job, out)
    await c.orch.close()
    assert out == [FIRST, *REST] and job.prefill_instance == "p1"
    assert c.charges() == {} and c.reserved() == {}


async def test_a_one_token_request_is_prefill_only():
    """max_tokens 1: token 0 is the whole answer. No decode is reserved and the Prefill
    carries no ticket, so no KV is pushed; a failed prefill is retried on another."""
    c = Cluster(prefills=("p0", "p1"), decodes=("d0",))
    c.w["p0"].fail["Prefill"] = grpc.StatusCode.UNAVAILABLE
    job = Job(
        request_id="r1",
        token_ids=list(range(1, 40)),
        params=SamplingParams(max_tokens=1),
    )
    out: list[int] = []
    await collect(c.orch, job, out)
    await c.orch.close()
    assert out == [FIRST] and job.prefill_instance == "p1"
    assert c.w["d0"].calls == []
    assert [p.HasField("ticket") for p in c.w["p0"].prefills + c.w["p1"].prefills] == [
        False,
        False,
    ]
    assert c.charges() == {} and c.reserved() == {}


async def test_a_colocated_worker_lost_before_its_first_chunk_is_retried(monkeypatch):
    """Silent (SIGSTOPped) before its first chunk: the watchdog sees it stop heartbeating
    and the request goes to the other colocated worker instead of failing."""
    from pdserve.router.lifecycle import orchestrator as orch_mod

    monkeypatch.setattr(orch_mod, "DECODE_WATCH_S", 0.01)
    c = Cluster(prefills=(), decodes=(), colocated=("c0", "c1"))
    c.w["c0"].gate["Generate"] = asyncio.Event()  # never answers
    out: list[int] = []
    job = c.job()
    task = asyncio.create_task(collect(c.orch, job, out))
    await until(lambda: c.w["c0"].calls == ["Generate"])
    c.registry.get("c0").last_heartbeat -= 1000.0  # stopped heartbeating
    await asyncio.wait_for(task, 5)
    await c.orch.close()
    assert out == [FIRST, *REST] and job.decode_instance == "c1"
    assert c.charges() == {}


async def test_a_colocated_stream_that_ends_before_its_first_chunk_is_retried():
    c = Cluster(prefills=(), decodes=(), colocated=("c0", "c1"))
    c.w["c0"].empty.add("Generate")
    out: list[int] = []
    job = c.job()
    await collect(c.orch, job, out)
    await c.orch.close()
    assert out == [FIRST, *REST] and job.decode_instance == "c1"
    assert c.charges() == {}
