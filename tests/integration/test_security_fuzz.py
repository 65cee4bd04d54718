"""Hypothesis fuzzing of the public API and of every internal API, each with valid
credentials for it, against a real 1 prefill + 1 decode + kvstore cluster under mutual TLS.

For every call: the status is never INTERNAL or UNKNOWN (bad input is INVALID_ARGUMENT, or
another deliberate code). Afterwards: both workers still registered and serving, no KV block
leaked on either worker, and an honest request still gets its tokens. Bounded: about 100
examples per API (fewer where each call does real work), no shrinking deadline.
"""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

from .conftest import VOCAB, pool_idle, start_cluster, wait_until

pytestmark = pytest.mark.integration

GOOD_SAMPLING = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
BAD_CODES = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    derandomize=True,
)

int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
doubles = st.floats(allow_nan=True, allow_infinity=True)
ids = st.one_of(
    st.text(max_size=40),
    st.from_regex(r"[A-Za-z0-9_.:-]{1,20}", fullmatch=True),
    st.just(""),
)
tokens = st.lists(st.one_of(st.integers(0, VOCAB - 1), int32), max_size=80)
blobs = st.binary(max_size=64)


@pytest.fixture(scope="module")
def cluster(serving_model_dir):
    c = start_cluster(serving_model_dir, prefill=1, decode=1, kvstore=True)
    try:
        yield c
    finally:
        c.stop()


@st.composite
def sampling(draw) -> common_pb2.SamplingParams:
    sp = common_pb2.SamplingParams(
        top_k=draw(st.one_of(st.just(0), int32)),
        ignore_eos=draw(st.booleans()),
        stop_token_ids=draw(st.lists(int32, max_size=4)),
        stop=draw(st.lists(st.text(max_size=8), max_size=3)),
    )
    if draw(st.booleans()):
        sp.max_tokens = draw(st.one_of(st.integers(0, 8), uint32))
    else:
        sp.max_tokens = 4
    if draw(st.booleans()):
        sp.temperature = draw(floats)
    if draw(st.booleans()):
        sp.top_p = draw(floats)
    if draw(st.booleans()):
        sp.seed = draw(uint64)
    return sp


def _code(call) -> grpc.StatusCode:
    try:
        out = call()
        if hasattr(out, "__iter__") and not hasattr(out, "SerializeToString"):
            list(out)
    except grpc.RpcError as exc:
        if exc.code() in BAD_CODES:
            raise AssertionError(f"{exc.code()}: {exc.details()}") from None
        return exc.code()
    return grpc.StatusCode.OK


def _healthy_after(cluster) -> None:
    for name in ("prefill0", "decode0"):
        wait_until(lambda n=name: pool_idle(cluster, n), 60, f"{name} pool idle (no leak)")
    with grpc.insecure_channel(cluster.addr) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        status = stub.Status(router_pb2.StatusRequest(), timeout=5)
        assert sum(i.state == "serving" for i in status.instances) == 2
        req = router_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        )
        req.token_ids.ids.extend([5, 6, 7])
        out = list(stub.Generate(req, timeout=60))
    assert sum(len(r.token_ids) for r in out) == 3


@st.composite
def generate_requests(draw) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(
        request_id=draw(ids),
        sampling=draw(sampling()),
        session_id=draw(st.one_of(st.just(""), st.text(max_size=20))),
    )
    kind = draw(st.sampled_from(["text", "token_ids", "chat", "none"]))
    if kind == "text":
        req.text = draw(st.text(max_size=100))
    elif kind == "token_ids":
        req.token_ids.ids.extend(draw(tokens))
    elif kind == "chat":
        for role, content in draw(
            st.lists(
                st.tuples(
                    st.sampled_from(["user", "system", "assistant", "x", ""]), st.text(max_size=20)
                ),
                max_size=4,
            )
        ):
            req.chat.messages.add(role=role, content=content)
    return req


def test_fuzz_public_generate(cluster):
    with grpc.insecure_channel(cluster.addr) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        @FUZZ
        @given(generate_requests())
        def run(req):
            _code(lambda: stub.Generate(req, timeout=60))

        run()
    _healthy_after(cluster)


EDGE_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e308, 0.0, 1e-9, 2.0])
valid_ids = st.from_regex(r"[A-Za-z0-9_.:-]{1,20}", fullmatch=True)


@st.composite
def decode_requests(draw) -> worker_pb2.DecodeRequest:
    """Mostly well-formed except for one or two fields, so the checks deep in the call are
    reached (a random request would be refused at its first field)."""
    prompt = draw(
        st.one_of(
            st.just([]),
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64),
            tokens,
        )
    )
    req = worker_pb2.DecodeRequest(
        request_id=draw(st.one_of(valid_ids, valid_ids, ids)),
        num_predicted_tokens=draw(st.one_of(st.integers(0, 64), uint32)),
        lease_s=draw(st.one_of(EDGE_FLOATS, st.floats(0, 5), doubles)),
        prompt_token_ids=prompt,
        write_back=draw(st.booleans()),
    )
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling()))
    return req


def test_fuzz_worker_api_as_the_router(cluster):
    """Decode (its ticket read, then left and aborted), Abort, Info, SetRole with invalid
    roles on the decode;
    Prefill with random tickets on the prefill."""
    with (
        cluster.internal_channel("decode0", as_name="router") as dch,
        cluster.internal_channel("prefill0", as_name="router") as pch,
    ):
        dec, pre = worker_pb2_grpc.WorkerStub(dch), worker_pb2_grpc.WorkerStub(pch)
        kv_fp = dec.Info(worker_pb2.InfoRequest(), timeout=5).kv_fingerprint

        @FUZZ
        @given(decode_requests())
        def decode(req):
            def ticket() -> None:
                stream = dec.Decode(req, timeout=10)
                try:
                    next(stream)
                finally:
                    stream.cancel()

            if _code(ticket) == grpc.StatusCode.OK:
                _code(lambda: dec.Abort(worker_pb2.AbortRequest(request_id=req.request_id)))

        @settings(FUZZ, max_examples=40)
        @given(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40),
            st.one_of(st.just(GOOD_SAMPLING), st.just(GOOD_SAMPLING), sampling()),
            st.one_of(st.integers(1, 2**47).map(lambda t: t << 16), st.just(1 << 16), uint64),
            st.one_of(st.binary(min_size=1, max_size=64), st.binary(min_size=100, max_size=400)),
            st.sampled_from([0, 0, 0, -1, 1]),
            st.one_of(st.just(time.time() + 600), st.just(time.time() + 600), EDGE_FLOATS),
            st.one_of(st.just(kv_fp), st.just(kv_fp), st.text(max_size=10)),
        )
        def prefill(toks, sp, tag, addr, off, expiry, fp):
            """Well-formed but for the ticket's target: a random UCX address and tag."""
            ticket = worker_pb2.Ticket(
                ticket_id=tag,
                tag_base=tag,
                ucx_worker_address=addr,
                num_blocks=max(0, -(-len(toks) // 16) + off),
                lease_expiry_unix_s=expiry,
                kv_fingerprint=fp,
            )
            req = worker_pb2.PrefillRequest(
                request_id="fuzz-prefill", token_ids=toks, sampling=sp, ticket=ticket
            )
            _code(lambda: pre.Prefill(req, timeout=30))

        @FUZZ
        @given(ids, st.integers(-5, 10).filter(lambda r: r not in (1, 2, 3)))
        def misc(rid, role):
            _code(lambda: dec.Abort(worker_pb2.AbortRequest(request_id=rid), timeout=5))
            _code(lambda: dec.SetRole(worker_pb2.SetRoleRequest(role=role), timeout=5))
            _code(lambda: dec.Info(worker_pb2.InfoRequest(), timeout=5))

        decode()
        prefill()
        misc()
    _healthy_after(cluster)


hashes = st.lists(st.one_of(st.binary(min_size=16, max_size=16), blobs), max_size=6)


def test_fuzz_kvstore_as_a_worker(cluster):
    with cluster.internal_channel("kvstore", as_name="worker") as ch:
        kv = kvstore_pb2_grpc.KVStoreStub(ch)

        @FUZZ
        @given(st.text(max_size=12), hashes, uint32, st.integers(0, 1 << 16), uint64, blobs)
        def run(ns, hs, first, bpb, tag, addr):
            _code(lambda: kv.Lookup(kvstore_pb2.LookupRequest(namespace=ns, block_hashes=hs)))
            _code(lambda: kv.Pin(kvstore_pb2.PinRequest(namespace=ns, block_hashes=hs)))
            _code(lambda: kv.Unpin(kvstore_pb2.PinRequest(namespace=ns, block_hashes=hs)))
            _code(
                lambda: kv.BeginPut(
                    kvstore_pb2.BeginPutRequest(
                        namespace=ns, block_hashes=hs, first_block=first, bytes_per_block=bpb
                    ),
                    timeout=5,
                )
            )
            _code(
                lambda: kv.Fetch(
                    kvstore_pb2.FetchRequest(
                        namespace=ns, block_hashes=hs, ucx_worker_address=addr, tag=tag
                    ),
                    timeout=15,
                )
            )
            _code(lambda: kv.Stats(kvstore_pb2.StatsRequest(), timeout=5))

        run()
    _healthy_after(cluster)


def test_fuzz_registry_as_a_worker(cluster):
    with cluster.internal_channel("router", as_name="worker") as ch:
        reg = router_pb2_grpc.RegistryStub(ch)

        @FUZZ
        @given(ids, st.text(max_size=30), int32, st.text(max_size=20), uint32, doubles, uint32)
        def run(iid, address, role, fp, block_size, step_ms, free):
            load = common_pb2.WorkerLoad(step_ms_ewma=step_ms, free_blocks=free)
            _code(
                lambda: reg.Register(
                    router_pb2.RegisterRequest(
                        instance_id=iid,
                        address=address,
                        role=role,
                        model_fingerprint=fp,
                        block_size=block_size,
                        load=load,
                    ),
                    timeout=5,
                )
            )
            _code(
                lambda: reg.Heartbeat(
                    router_pb2.HeartbeatRequest(instance_id=iid, role=role, state=fp, load=load),
                    timeout=5,
                )
            )
            _code(lambda: reg.Deregister(router_pb2.DeregisterRequest(instance_id=iid), timeout=5))

        run()
    _healthy_after(cluster)
