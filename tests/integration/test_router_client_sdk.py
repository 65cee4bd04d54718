"""(Integration) The client SDK against an in-process fake Router servicer on 127.0.0.1:
events and results, typed errors, retry before the first token only, the sync
client, chat sessions."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time

import grpc
import pytest

from pdserve.client import (
    AsyncChatSession,
    AsyncClient,
    Cancelled,
    ChatSession,
    Client,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    PdserveClientError,
    ResourceExhausted,
    Unavailable,
)
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc

pytestmark = pytest.mark.integration


class FakeRouter(router_pb2_grpc.RouterServicer):
    def __init__(self) -> None:
        self.fail_first: list[grpc.StatusCode] = []  # abort the next calls with these
        self.fail_after_first_token: grpc.StatusCode | None = None
        self.calls = 0
        self.requests: list[router_pb2.GenerateRequest] = []
        self.hang = False

    async def Generate(self, request, context):
        self.calls += 1
        self.requests.append(request)
        if self.fail_first:
            await context.abort(self.fail_first.pop(0), f"fake failure {self.calls}")
        if self.hang:
            await asyncio.sleep(30)
        ids = list(request.token_ids.ids) or [len(request.text)]
        n = request.sampling.max_tokens
        for i in range(n):
            last = i == n - 1
            if i == 1 and self.fail_after_first_token is not None:
                await context.abort(self.fail_after_first_token, "died mid-stream")
            resp = router_pb2.GenerateResponse(
                request_id=request.request_id,
                token_ids=[ids[0] + i],
                text=f"t{i} ",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
            )
            if last:
                resp.usage.CopyFrom(
                    router_pb2.Usage(
                        prompt_tokens=len(ids),
                        completion_tokens=n,
                        cached_tokens=1,
                        stages=common_pb2.StageCosts(prefill_ms=3.0),
                        prefill_instance="p0",
                    )
                )
            yield resp

    async def Status(self, request, context):
        return router_pb2.StatusResponse(
            instances=[
                router_pb2.InstanceStatus(
                    instance_id="p0", address="127.0.0.1:9", role=1, state="serving"
                )
            ],
            requests_total=4,
            prompt_tokens_total=100,
            cached_tokens_total=25,
            model="m",
        )


@pytest.fixture
async def fake():
    servicer = FakeRouter()
    server = grpc.aio.server()
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    servicer.addr = f"127.0.0.1:{port}"
    yield servicer
    await server.stop(0)


async def test_stream_events_and_result(fake):
    async with AsyncClient(fake.addr) as c:
        events = [e async for e in c.generate_stream(token_ids=[7, 8], max_tokens=3)]
        res = await c.generate(
            token_ids=[7, 8],
            max_tokens=3,
            temperature=0.5,
            top_p=0.9,
            top_k=4,
            seed=11,
            ignore_eos=True,
            session_id="s-1",
        )
    assert [e.token_ids for e in events] == [[7], [8], [9]]
    assert [e.finish_reason for e in events] == [None, None, "length"]
    assert events[-1].usage.stages["prefill_ms"] == 3.0 and events[0].usage is None
    assert all(b.arrival_s >= a.arrival_s for a, b in itertools.pairwise(events))
    assert (res.token_ids, res.text, res.finish_reason) == ([7, 8, 9], "t0 t1 t2 ", "length")
    assert (res.prompt_tokens, res.cached_tokens) == (2, 1)
    assert len(res.token_times) == 3 and res.e2e_ms >= res.ttft_ms > 0 and res.tpot_ms >= 0
    sent = fake.requests[-1]
    assert (sent.sampling.max_tokens, sent.sampling.top_k, sent.sampling.seed) == (3, 4, 11)
    assert sent.sampling.ignore_eos and sent.session_id == "s-1"
    assert abs(sent.sampling.temperature - 0.5) < 1e-6 and abs(sent.sampling.top_p - 0.9) < 1e-6


@pytest.mark.parametrize(
    "code, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgument),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, ResourceExhausted),
        (grpc.StatusCode.UNAVAILABLE, Unavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceeded),
        (grpc.StatusCode.CANCELLED, Cancelled),
        (grpc.StatusCode.INTERNAL, Internal),
        (grpc.StatusCode.NOT_FOUND, PdserveClientError),
    ],
)
async def test_typed_errors_carry_server_message(fake, code, cls):
    fake.fail_first = [code]
    async with AsyncClient(fake.addr, max_retries=0) as c:
        with pytest.raises(cls) as info:
            await c.generate(token_ids=[1], max_tokens=2)
    assert isinstance(info.value, PdserveClientError)
    assert info.value.message == "fake failure 1" and info.value.code == code


async def test_retry_on_unavailable_before_first_token(fake):
    fake.fail_first = [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE]
    async with AsyncClient(fake.addr, max_retries=2, retry_backoff_s=0.01) as c:
        res = await c.generate(token_ids=[1], max_tokens=2)
    assert res.token_ids == [1, 2] and fake.calls == 3
    fake.fail_first = [grpc.StatusCode.UNAVAILABLE] * 3
    fake.calls = 0
    async with AsyncClient(fake.addr, max_retries=2, retry_backoff_s=0.01) as c:
        with pytest.raises(Unavailable):
            await c.generate(token_ids=[1], max_tokens=2)
    assert fake.calls == 3  # bounded


async def test_no_retry_after_first_token_or_other_codes(fake):
    fake.fail_after_first_token = grpc.StatusCode.UNAVAILABLE
    async with AsyncClient(fake.addr, max_retries=3, retry_backoff_s=0.01) as c:
        with pytest.raises(Unavailable, match="mid-stream"):
            await c.generate(token_ids=[1], max_tokens=4)
        assert fake.calls == 1
        fake.fail_after_first_token = None
        fake.fail_first = [grpc.StatusCode.INVALID_ARGUMENT]
        with pytest.raises(InvalidArgument):
            await c.generate(token_ids=[1], max_tokens=4)
    assert fake.calls == 2


async def test_deadline(fake):
    fake.hang = True
    async with AsyncClient(fake.addr, timeout=0.3) as c:
        with pytest.raises(DeadlineExceeded):
            await c.generate(token_ids=[1], max_tokens=2)


async def test_status(fake):
    async with AsyncClient(fake.addr) as c:
        st = await c.status()
    assert st.instances[0].role == "prefill" and st.cache_hit_rate == 0.25
    assert st.to_dict()["requests_total"] == 4


async def test_async_chat_session_keeps_history(fake):
    async with AsyncClient(fake.addr) as c:
        chat = AsyncChatSession(c, system="be brief", max_tokens=2)
        r1 = await chat.send("hello")
        await chat.send("again", max_tokens=1)
    assert r1.text == "t0 t1 "
    assert chat.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "t0 t1 "},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "t0 "},
    ]
    sent = fake.requests[-1]
    assert [m.role for m in sent.chat.messages] == ["system", "user", "assistant", "user"]
    assert sent.session_id == chat.session_id == fake.requests[0].session_id


def test_sync_client_and_chat_session():
    # The fake server runs on its own loop in a thread; the sync client has its own.
    ready = threading.Event()
    state = {}

    def serve():
        async def main():
            servicer = FakeRouter()
            server = grpc.aio.server()
            router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
            state["port"] = server.add_insecure_port("127.0.0.1:0")
            state["servicer"], state["stop"] = servicer, asyncio.Event()
            await server.start()
            ready.set()
            await state["stop"].wait()
            await server.stop(0)

        loop = asyncio.new_event_loop()
        state["loop"] = loop
        loop.run_until_complete(main())

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    assert ready.wait(10)
    try:
        with Client(f"127.0.0.1:{state['port']}") as client:
            res = client.generate(prompt="abc", max_tokens=3)
            assert res.token_ids == [3, 4, 5] and res.finish_reason == "length"
            stream = client.generate_stream(token_ids=[1], max_tokens=5)
            assert next(stream).token_ids == [1]
            stream.close()  # leaving early cancels the call
            chat = ChatSession(client, max_tokens=2)
            assert "".join(e.text for e in chat.stream("hi")) == "t0 t1 "
            assert chat.send("more").text == "t0 t1 "
            assert len(chat.messages) == 4
            assert client.status().model == "m"
            state["servicer"].fail_first = [grpc.StatusCode.INVALID_ARGUMENT]
            with pytest.raises(InvalidArgument):
                client.generate(token_ids=[1], max_tokens=1)
    finally:
        state["loop"].call_soon_threadsafe(state["stop"].set)
        t.join(10)


# -- several routers: the SDK picks a live one, moves on, and resumes a broken stream


class ResumingRouter(FakeRouter):
    """A replica that hands out resume tokens and continues streams on Resume: token i of
    a stream is prompt[0] + i; it dies (UNAVAILABLE) after `die_after` tokens if set."""

    def __init__(self) -> None:
        super().__init__()
        self.die_after: int | None = None
        self.answered = False  # the router itself fails the stream (its verdict: no resume)
        self.mark = "1"  # "elsewhere": it has no instance left (another replica may)
        self.fail_resume = False  # a Resume here fails at once (the replica is going too)
        self.resumes: list[router_pb2.ResumeRequest] = []

    async def _stream(self, request, start: int, context):
        ids = list(request.token_ids.ids)
        n = request.sampling.max_tokens
        for i in range(start, n):
            if self.die_after is not None and i - start == self.die_after:
                if self.answered:  # what the router's ErrorInterceptor sends
                    await context.abort(
                        grpc.StatusCode.UNAVAILABLE, "decode instance d1: lost; no migration left",
                        trailing_metadata=(("pdserve-answered", self.mark),),
                    )  # fmt: skip
                await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            last = i == n - 1
            yield router_pb2.GenerateResponse(
                request_id=request.request_id,
                token_ids=[ids[0] + i],
                text=f"t{i} ",
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                resume_token="tok" if i == start else "",
            )

    async def Generate(self, request, context):
        self.calls += 1
        self.requests.append(request)
        async for resp in self._stream(request, 0, context):
            yield resp

    async def Resume(self, request, context):
        self.resumes.append(request)
        if self.fail_resume:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        async for resp in self._stream(request.request, len(request.received_token_ids), context):
            yield resp


@pytest.fixture
async def pair():
    out, servers = [], []
    for _ in range(2):
        servicer = ResumingRouter()
        server = grpc.aio.server()
        router_pb2_grpc.add_RouterServicer_to_server(servicer, server)
        servicer.addr = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        await server.start()
        out.append(servicer)
        servers.append(server)
    yield out
    for server in servers:
        await server.stop(0)


def _dead_addr() -> str:
    import socket

    with socket.socket() as s:  # a port nobody listens on (closed right away)
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


async def test_a_stream_resumes_on_the_other_router(pair):
    a, b = pair
    a.die_after = b.die_after = 3  # each router dies after 3 tokens of whatever it carries
    async with AsyncClient([a.addr, b.addr], retry_backoff_s=0.01) as c:
        res = await c.generate(token_ids=[10], max_tokens=8, request_id="s1")
    assert res.token_ids == list(range(10, 18)) and res.finish_reason == "length"
    assert res.text == "".join(f"t{i} " for i in range(8))  # each token once, in order
    resumes = sorted(a.resumes + b.resumes, key=lambda r: len(r.received_token_ids))
    assert [list(r.received_token_ids) for r in resumes] == [[10, 11, 12], [10, 11, 12, 13, 14, 15]]
    assert all(r.resume_token == "tok" and r.request.request_id == "s1" for r in resumes)
    assert resumes[0].received_text == "t0 t1 t2 "


async def test_an_unreachable_router_in_the_list_is_skipped(pair):
    a, _b = pair
    async with AsyncClient(f"{_dead_addr()},{a.addr}", retry_backoff_s=0.01) as c:
        for _ in range(4):  # whichever the round robin starts with
            res = await c.generate(token_ids=[1], max_tokens=2)
            assert res.token_ids == [1, 2]
        assert (await c.status()).model == "m"


async def test_all_routers_down_is_unavailable_naming_them():
    dead = [_dead_addr(), _dead_addr()]
    async with AsyncClient(dead, max_retries=2, retry_backoff_s=0.01) as c:
        with pytest.raises(Unavailable) as info:
            await c.generate(token_ids=[1], max_tokens=2)
        assert all(addr in info.value.message for addr in dead)
        with pytest.raises(Unavailable) as info:
            await c.status(timeout=2)
        assert all(addr in info.value.message for addr in dead)
    with pytest.raises(ValueError, match="no router address"):
        AsyncClient(" , ")


async def test_resume_gives_up_after_resume_timeout(pair):
    """Mid-stream, every router gone: Unavailable once resume_timeout_s passed."""
    a, _b = pair
    a.die_after, a.fail_resume = 2, True
    async with AsyncClient([a.addr, _dead_addr()], resume_timeout_s=0.5, retry_backoff_s=0.01) as c:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            await c.generate(token_ids=[1], max_tokens=6, request_id="r")
        assert time.monotonic() - t0 < 10  # (bounded: a hang guard)
    assert a.resumes, "it tried to resume"


async def test_a_stream_the_router_itself_failed_is_not_resumed(pair):
    """UNAVAILABLE that the router decided (its worker died past its migrations) is the
    stream's outcome; only a broken connection (the router died) is resumed."""
    a, b = pair
    a.die_after = b.die_after = 2
    a.answered = b.answered = True
    async with AsyncClient([a.addr, b.addr], retry_backoff_s=0.01) as c:
        with pytest.raises(Unavailable, match="no migration left") as info:
            await c.generate(token_ids=[1], max_tokens=6)
    assert info.value.answered and not (a.resumes or b.resumes)


async def test_a_router_without_instances_sends_the_stream_to_another(pair):
    """A router that has no instance left ("elsewhere") does not end the stream: the SDK
    resumes it on a replica that has not said so; when every one has, the error is final."""
    a, b = pair
    a.die_after, a.answered, a.mark = 2, True, "elsewhere"
    async with AsyncClient([a.addr, b.addr], retry_backoff_s=0.01) as c:
        c.routers._next = 0  # the stream starts on a
        result = await c.generate(token_ids=[1], max_tokens=6)
    assert result.token_ids == [1, 2, 3, 4, 5, 6] and len(b.resumes) == 1 and not a.resumes

    b.die_after, b.answered, b.mark = 0, True, "elsewhere"  # b has none left either
    b.resumes.clear()
    async with AsyncClient([a.addr, b.addr], retry_backoff_s=0.01) as c:
        c.routers._next = 0
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="no migration left") as info:
            await c.generate(token_ids=[1], max_tokens=6)
        assert time.monotonic() - t0 < 10  # final at once, not after resume_timeout_s
    assert info.value.elsewhere and len(b.resumes) == 1 and not a.resumes
