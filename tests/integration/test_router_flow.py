"""The router process against fake workers on 127.0.0.1: registry, disaggregated
and colocated orchestration, retries, cancellation, validation, SDK errors."""

from __future__ import annotations

import asyncio
import itertools

import grpc
import pytest

from pdserve.client import AsyncClient, InvalidArgument, PdserveClientError, Unavailable
from pdserve.v1 import router_pb2, router_pb2_grpc

from .router_fakes import (
    FINGERPRINT,
    Behaviour,
    FakeWorker,
    Log,
    RouterProcess,
    fake_first_token,
    make_model_dir,
)

pytestmark = pytest.mark.integration
PREFILL, DECODE, COLOCATED = 1, 2, 3
_ids = itertools.count()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model_dir(tmp_path_factory.mktemp("router-model"))


@pytest.fixture(scope="module")
def router(model_dir):
    # No migration here: the fakes' tokens depend on their prompt, so a continuation could
    # not match; migration is tested with real workers (test_migration.py).
    proc = RouterProcess(
        model_dir,
        "--policy",
        "least_loaded",
        "--max-prefill-attempts",
        "3",
        "--max-migrations",
        "0",
    )
    yield proc
    assert proc.stop() == 0


@pytest.fixture
async def cluster(router):
    """Start fakes with `await cluster.add(name, role, behaviour)`; all stopped after."""
    log = Log()
    workers: list[FakeWorker] = []

    class Cluster:
        def __init__(self):
            self.log = log

        async def add(self, name, role, behaviour=None, **kw):
            w = FakeWorker(f"{name}-{next(_ids)}", role, log, behaviour, **kw)
            workers.append(w)
            return await w.start(router.internal_addr)

    yield Cluster()
    for w in workers:
        await w.stop()


async def status(addr) -> router_pb2.StatusResponse:
    async with grpc.aio.insecure_channel(addr) as ch:
        return await router_pb2_grpc.RouterStub(ch).Status(router_pb2.StatusRequest(), timeout=5)


async def test_register_heartbeat_expiry_and_reregister(router, cluster):
    p = await cluster.add("p", PREFILL)
    d = await cluster.add("d", DECODE)
    st = await status(router.addr)
    roles = {i.instance_id: i.role for i in st.instances}
    assert roles[p.instance_id] == PREFILL and roles[d.instance_id] == DECODE
    # A silent instance disappears after the heartbeat timeout (2 s).
    await p.stop_heartbeat()
    for _ in range(150):
        await asyncio.sleep(0.1)
        ids = {i.instance_id for i in (await status(router.addr)).instances}
        if p.instance_id not in ids:
            break
    assert p.instance_id not in ids and d.instance_id in ids
    # Its next heartbeat is answered known=false.
    async with grpc.aio.insecure_channel(router.internal_addr) as ch:
        resp = await router_pb2_grpc.RegistryStub(ch).Heartbeat(
            router_pb2.HeartbeatRequest(instance_id=p.instance_id, role=PREFILL), timeout=5
        )
    assert resp.known is False


async def test_fingerprint_mismatch_rejected(router, cluster):
    await cluster.add("d", DECODE)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await cluster.add("other", PREFILL, fingerprint="another-model")
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert FINGERPRINT in info.value.details()


async def test_disagg_order_tokens_and_usage(router, cluster):
    p = await cluster.add("p", PREFILL)
    d = await cluster.add("d", DECODE)
    async with AsyncClient(router.addr) as c:
        before = await c.status()
        res = await c.generate(
            token_ids=[5, 6, 7], max_tokens=5, temperature=0.0, request_id="r-order"
        )
        after = await c.status()
    assert after.requests_total == before.requests_total + 1
    assert after.prompt_tokens_total == before.prompt_tokens_total + 3
    assert after.cached_tokens_total == before.cached_tokens_total + 2  # -> hit rate
    first = fake_first_token([5, 6, 7])
    assert res.token_ids == [first, first + 1, first + 2, first + 3, first + 4]
    assert res.finish_reason == "length"
    assert cluster.log.of("r-order") == [  # two worker calls: one stream reserves and decodes
        (d.instance_id, "Decode"),
        (p.instance_id, "Prefill"),
    ]
    u = res.usage
    assert (u.prompt_tokens, u.completion_tokens, u.cached_tokens) == (3, 5, 2)
    assert u.stages["prefill_ms"] == 1.5 and u.stages["decode_ms"] == 2.5  # summed per stage
    # the router's own stage: Decode opened -> ticket read (a real gRPC round trip)
    assert 0.0 < u.stages["reserve_ms"] < res.ttft_ms
    assert (u.prefill_instance, u.decode_instance) == (p.instance_id, d.instance_id)
    assert res.prompt_tokens == 3 and res.cached_tokens == 2
    assert len(res.token_times) == 5 and res.ttft_ms > 0 and res.e2e_ms >= res.ttft_ms


async def test_first_token_arrives_before_decode_starts(router, cluster):
    gate = asyncio.Event()
    await cluster.add("p", PREFILL)
    d = await cluster.add("d", DECODE, Behaviour(decode_gate=gate))
    async with AsyncClient(router.addr) as c:
        stream = c.generate_stream(token_ids=[1, 2, 3, 4], max_tokens=4, request_id="r-first")
        ev = await asyncio.wait_for(stream.__anext__(), 10)
        assert ev.token_ids == [fake_first_token([1, 2, 3, 4])]
        assert not gate.is_set()  # decode is still blocked: the first token did not wait for it
        gate.set()
        rest = [e async for e in stream]
    assert sum(len(e.token_ids) for e in rest) == 3 and rest[-1].finish_reason == "length"
    assert (d.instance_id, "Decode") in cluster.log.of("r-first")


async def test_prefill_failure_retries_elsewhere_and_aborts_ticket(router, cluster):
    # Least-loaded picks the lowest id on a tie: "a-broken" is tried first.
    bad = await cluster.add(
        "a-broken", PREFILL, Behaviour(prefill_error=grpc.StatusCode.UNAVAILABLE)
    )
    good = await cluster.add("b-good", PREFILL)
    d = await cluster.add("d", DECODE)
    async with AsyncClient(router.addr) as c:
        res = await c.generate(token_ids=[9, 9], max_tokens=3, request_id="r-retry")
    assert res.finish_reason == "length" and len(res.token_ids) == 3
    # (the failed prefill is also told to Abort, in the background: leave it out)
    calls = [c for c in cluster.log.of("r-retry") if c != (bad.instance_id, "Abort")]
    assert calls == [
        (d.instance_id, "Decode"),
        (bad.instance_id, "Prefill"),
        (d.instance_id, "Abort"),  # the first ticket is released, then re-reserved
        (d.instance_id, "Decode"),
        (good.instance_id, "Prefill"),
    ]
    assert res.usage.prefill_instance == good.instance_id


async def test_all_prefills_failing_gives_unavailable(router, cluster):
    await cluster.add("x", PREFILL, Behaviour(prefill_error=grpc.StatusCode.UNAVAILABLE))
    await cluster.add("d", DECODE)
    async with AsyncClient(router.addr, max_retries=0) as c:
        with pytest.raises(Unavailable, match="is broken"):
            await c.generate(token_ids=[1], max_tokens=3)


async def test_no_decode_is_unavailable_promptly(router, cluster):
    await cluster.add("p", PREFILL)
    async with AsyncClient(router.addr, max_retries=0, timeout=10) as c:
        with pytest.raises(Unavailable, match="no decode"):
            await c.generate(token_ids=[1, 2], max_tokens=3)


async def test_decode_failure_is_unavailable_and_instance_suspect(router, cluster):
    await cluster.add("p", PREFILL)
    d = await cluster.add("d", DECODE, Behaviour(decode_error=grpc.StatusCode.UNAVAILABLE))
    async with AsyncClient(router.addr, max_retries=0) as c:
        events = []
        with pytest.raises(Unavailable, match=f"decode instance {d.instance_id}"):
            async for ev in c.generate_stream(token_ids=[2, 2], max_tokens=4):
                events.append(ev)
        assert len(events) == 1  # the first token (from prefill) was already streamed
        st = await c.status()
    assert {i.instance_id: i.state for i in st.instances}[d.instance_id] == "suspect"


async def test_client_cancel_aborts_decode(router, cluster):
    p = await cluster.add("p", PREFILL)
    d = await cluster.add("d", DECODE, Behaviour(decode_forever=True, chunk_delay_s=0.02))
    async with AsyncClient(router.addr) as c:
        stream = c.generate_stream(token_ids=[3, 1], max_tokens=100, request_id="r-cancel")
        got = [await stream.__anext__() for _ in range(3)]
        assert all(e.finish_reason is None for e in got)
        await stream.aclose()  # the client goes away mid-stream
        assert await cluster.log.wait_for((d.instance_id, "Abort", "r-cancel"))
    assert (p.instance_id, "Prefill") in cluster.log.of("r-cancel")


@pytest.mark.parametrize("stage", ["reserve", "prefill"])
async def test_client_cancel_before_first_token_aborts_every_holder(router, cluster, stage):
    # Cancelled before the Decode stream sent its ticket the decode may hold a reservation
    # the router never saw a ticket for; while Prefill runs both instances hold the request.
    gate = asyncio.Event()
    p = await cluster.add(
        "p", PREFILL, Behaviour(prefill_gate=gate if stage == "prefill" else None)
    )
    d = await cluster.add("d", DECODE, Behaviour(reserve_gate=gate if stage == "reserve" else None))
    rid = f"r-cancel-{stage}"
    waiting_in = (
        (d.instance_id, "Decode", rid) if stage == "reserve" else (p.instance_id, "Prefill", rid)
    )
    async with AsyncClient(router.addr) as c:
        task = asyncio.create_task(c.generate(token_ids=[3, 1], max_tokens=5, request_id=rid))
        assert await cluster.log.wait_for(waiting_in)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await cluster.log.wait_for((d.instance_id, "Abort", rid))
        if stage == "prefill":
            assert await cluster.log.wait_for((p.instance_id, "Abort", rid))
        for _ in range(100):  # the router counts it finished once its handler unwound
            if (await c.status()).requests_running == 0:
                break
            await asyncio.sleep(0.02)
        assert (await c.status()).requests_running == 0
    gate.set()
    assert cluster.log.of(rid).count((d.instance_id, "Decode")) == 1
    assert cluster.log.of(rid).count((d.instance_id, "Abort")) == 1


async def test_bad_input_names_field_and_router_keeps_serving(router, cluster):
    await cluster.add("p", PREFILL)
    await cluster.add("d", DECODE)
    async with AsyncClient(router.addr) as c:
        cases = [
            (dict(token_ids=[1], max_tokens=0), "max_tokens"),
            (dict(token_ids=[1], max_tokens=2, temperature=-1.0), "temperature"),
            (dict(token_ids=[1], max_tokens=2, top_p=0.0), "top_p"),
            (dict(token_ids=[1], max_tokens=2, top_k=-3), "top_k"),
            (dict(token_ids=[10**6], max_tokens=2), "token_ids.ids"),
            (dict(token_ids=[1], max_tokens=10_000), "max_tokens"),
            (dict(prompt="", max_tokens=2), "prompt"),
            (dict(token_ids=[1], max_tokens=2, session_id="no spaces"), "session_id"),
            (dict(token_ids=[1], max_tokens=2, stop=[""]), "stop"),
            (dict(messages=[{"role": "robot", "content": "x"}], max_tokens=2), "chat"),
        ]
        for kwargs, fieldname in cases:
            with pytest.raises(InvalidArgument) as info:
                await c.generate(**kwargs)
            assert info.value.message.startswith(fieldname), (kwargs, info.value.message)
        res = await c.generate(prompt="The harbor", max_tokens=2)
        assert res.finish_reason == "length"


async def test_text_stop_string_and_multibyte(router, cluster, model_dir):
    from pdserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    script = tok.encode(" 日本語 🚢 Café END and more", add_special_tokens=False)
    first = tok.encode("Ångström", add_special_tokens=False)
    await cluster.add("p", PREFILL, Behaviour(first_token=first[0]))
    # (a token every 10 ms: the stop string reaches the router while the decode still runs,
    # so the router must abort it; a decode that had finished would need no abort)
    d = await cluster.add("d", DECODE, Behaviour(script=first[1:] + script, chunk_delay_s=0.01))
    async with AsyncClient(router.addr) as c:
        events = [
            e
            async for e in c.generate_stream(
                prompt="Stop here.", max_tokens=60, stop=["END"], request_id="r-stop"
            )
        ]
        res_text = "".join(e.text for e in events)
        assert res_text == "Ångström 日本語 🚢 Café "
        assert "\ufffd" not in res_text and events[-1].finish_reason == "stop"
        assert await cluster.log.wait_for((d.instance_id, "Abort", "r-stop"))
        # The same script without a stop string: everything, no split characters.
        res = await c.generate(prompt="Stop here.", max_tokens=1 + len(first) - 1 + len(script))
    assert res.text == "Ångström 日本語 🚢 Café END and more"
    assert res.finish_reason == "length"


async def test_chat_prompt_rendered_with_template(router, cluster, model_dir):
    from pdserve.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    expected = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    await cluster.add("p", PREFILL)
    await cluster.add("d", DECODE)
    async with AsyncClient(router.addr) as c:
        res = await c.generate(messages=messages, max_tokens=2)
    assert res.prompt_tokens == len(expected)
    assert res.token_ids[0] == fake_first_token(expected)  # the prefill saw exactly these ids


async def test_eos_as_first_token_finishes_without_decode(router, cluster, model_dir):
    from pdserve.model.tokenizer import Tokenizer

    eos = Tokenizer.from_dir(model_dir).token_to_id("<|eos|>")
    await cluster.add("p", PREFILL, Behaviour(first_token=eos))
    d = await cluster.add("d", DECODE)
    async with AsyncClient(router.addr) as c:
        res = await c.generate(token_ids=[1, 2], max_tokens=10, request_id="r-eos")
        one = await c.generate(token_ids=[1, 2], max_tokens=1, ignore_eos=True, request_id="r-one")
    assert (res.finish_reason, res.token_ids) == ("stop", [eos])
    assert (one.finish_reason, one.token_ids) == ("length", [eos])
    # EOS as token 0: the decode reserved for the rest is freed (its stream left, aborted)
    assert await cluster.log.wait_for((d.instance_id, "Abort", "r-eos"))
    assert cluster.log.of("r-eos").count((d.instance_id, "Decode")) == 1
    # max_tokens 1: prefill only, the decode never hears of it
    assert [m for i, m in cluster.log.of("r-one") if i == d.instance_id] == []


async def test_colocated_generate(router, cluster):
    w = await cluster.add("c", COLOCATED)
    async with AsyncClient(router.addr) as c:
        before = (await c.status()).requests_total
        res = await c.generate(token_ids=[4, 4], max_tokens=4, request_id="r-colo")
        st = await c.status()
    first = fake_first_token([4, 4])
    assert res.token_ids == [first, first + 1, first + 2, first + 3]
    assert cluster.log.of("r-colo") == [(w.instance_id, "Generate")]
    assert st.requests_total == before + 1
    assert {i.instance_id: i.role for i in st.instances}[w.instance_id] == "colocated"


async def test_sdk_typed_error_for_unreachable_router():
    async with AsyncClient("127.0.0.1:1", max_retries=1, retry_backoff_s=0.01, timeout=5) as c:
        with pytest.raises(Unavailable) as info:
            await c.generate(token_ids=[1], max_tokens=1)
    assert isinstance(info.value, PdserveClientError)
