"""The internal plane against a stranger and against the wrong member, with real processes:
a 1 prefill + 1 decode + kvstore cluster under mutual TLS (the launcher's default).

- nobody without a cluster certificate gets through (router registry, worker, kvstore);
- the public port serves none of the internal services;
- a valid certificate of the wrong role is PERMISSION_DENIED, and so is a registration under
  another identity's instance id;
- the honest cluster serves exact tokens under TLS;
- bounded input and checked ids: a 10 MB prompt, bad and duplicate request ids, leases of
  NaN / inf, undecodable bodies.
"""

from __future__ import annotations

import json
import math
import threading
import time

import grpc
import pytest

from pdserve.v1 import (
    common_pb2,
    kvstore_pb2,
    kvstore_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

from .conftest import mixed_requests, pool_idle, reference_tokens, start_cluster, wait_until

pytestmark = pytest.mark.integration

GREEDY = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(serving_model_dir):
    from pdserve.rpc.certs import make_cert

    c = start_cluster(serving_model_dir, prefill=1, decode=1, kvstore=True)
    try:
        assert c.tls_dir is not None, "the launcher must run mutual TLS by default"
        make_cert(c.tls_dir, "worker", "intruder")  # a valid worker cert nobody registered
        yield c
    finally:
        c.stop()


def _targets(c) -> dict[str, str]:
    return {
        "router-internal": c.internal_addr,
        "prefill0": f"127.0.0.1:{c.processes['prefill0'].port}",
        "decode0": f"127.0.0.1:{c.processes['decode0'].port}",
        "kvstore": f"127.0.0.1:{c.kvstore_port}",
    }


def _probe_calls(channel) -> list:
    """One call of each internal service (the target serves one of them)."""
    reg = router_pb2_grpc.RegistryStub(channel)
    wrk = worker_pb2_grpc.WorkerStub(channel)
    kv = kvstore_pb2_grpc.KVStoreStub(channel)
    return [
        lambda: reg.Register(
            router_pb2.RegisterRequest(instance_id="x", address="127.0.0.1:1"), timeout=5
        ),
        lambda: list(
            wrk.Decode(worker_pb2.DecodeRequest(request_id="x", prompt_token_ids=[1]), timeout=5)
        ),
        lambda: wrk.SetRole(worker_pb2.SetRoleRequest(role=common_pb2.ROLE_DECODE), timeout=5),
        lambda: kv.Clear(kvstore_pb2.ClearRequest(), timeout=5),
        lambda: kv.Lookup(kvstore_pb2.LookupRequest(namespace="n"), timeout=5),
    ]


def _code(call) -> grpc.StatusCode:
    try:
        call()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def _status(c) -> router_pb2.StatusResponse:
    with grpc.insecure_channel(c.addr) as ch:
        return router_pb2_grpc.RouterStub(ch).Status(router_pb2.StatusRequest(), timeout=5)


def _serving(c) -> int:
    return sum(1 for i in _status(c).instances if i.state == "serving")


def _generate(c, req: router_pb2.GenerateRequest, timeout: float = 60.0):
    with grpc.insecure_channel(c.addr) as ch:
        return list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=timeout))


def _gen_request(tokens, rid: str = "", sampling=GREEDY) -> router_pb2.GenerateRequest:
    req = router_pb2.GenerateRequest(request_id=rid, sampling=sampling)
    req.token_ids.ids.extend(tokens)
    return req


# ------------------------------------------------------------------------ strangers


def test_no_certificate_no_entry(cluster):
    """Plaintext, TLS without a client certificate, and a certificate from another CA: every
    internal listener refuses at the handshake (UNAVAILABLE), before any method runs."""
    from pdserve.rpc.certs import make_dev_pki
    from pdserve.rpc.tls import TARGET_NAME_OPTION, TlsFiles, secure_channel_sync

    other = cluster.log_dir / "other-ca"
    make_dev_pki(other, [("worker", "worker"), ("router", "router"), ("admin", "admin")])
    ca_only = grpc.ssl_channel_credentials((cluster.tls_dir / "ca.crt").read_bytes())
    for name, addr in _targets(cluster).items():
        channels = {
            "plaintext": grpc.insecure_channel(addr),
            "no client cert": grpc.secure_channel(addr, ca_only, options=[TARGET_NAME_OPTION]),
            "foreign CA (worker)": secure_channel_sync(addr, TlsFiles.in_dir(other, "worker")),
            "foreign CA (router)": secure_channel_sync(addr, TlsFiles.in_dir(other, "router")),
        }
        for how, ch in channels.items():
            with ch:
                for call in _probe_calls(ch):
                    code = _code(call)
                    assert code == grpc.StatusCode.UNAVAILABLE, f"{name} / {how}: {code}"
    assert _serving(cluster) == 2


def test_public_port_serves_no_internal_service(cluster):
    with grpc.insecure_channel(cluster.addr) as ch:
        for call in _probe_calls(ch):
            assert _code(call) == grpc.StatusCode.UNIMPLEMENTED
    # and the client API is not on the internal listener
    with cluster.internal_channel("router", as_name="admin") as ch:
        code = _code(lambda: router_pb2_grpc.RouterStub(ch).Status(router_pb2.StatusRequest()))
        assert code == grpc.StatusCode.UNIMPLEMENTED


# ------------------------------------------------------------------------ wrong member


WRONG_ROLE = [
    # (certificate, target, call)
    (
        "worker",
        "decode0",
        lambda ch: list(
            worker_pb2_grpc.WorkerStub(ch).Decode(
                worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2]), timeout=5
            )
        ),
    ),
    (
        "worker",
        "prefill0",
        lambda ch: worker_pb2_grpc.WorkerStub(ch).SetRole(
            worker_pb2.SetRoleRequest(role=common_pb2.ROLE_DECODE), timeout=5
        ),
    ),
    (
        "admin",
        "prefill0",
        lambda ch: worker_pb2_grpc.WorkerStub(ch).Drain(worker_pb2.DrainRequest(), timeout=5),
    ),
    (
        "kvstore",
        "decode0",
        lambda ch: worker_pb2_grpc.WorkerStub(ch).Abort(
            worker_pb2.AbortRequest(request_id="r"), timeout=5
        ),
    ),
    (
        "router",
        "kvstore",
        lambda ch: kvstore_pb2_grpc.KVStoreStub(ch).BeginPut(
            kvstore_pb2.BeginPutRequest(namespace="n", block_hashes=[b"h" * 16]), timeout=5
        ),
    ),
    (
        "worker",
        "kvstore",
        lambda ch: kvstore_pb2_grpc.KVStoreStub(ch).Clear(kvstore_pb2.ClearRequest(), timeout=5),
    ),
    (
        "worker",
        "kvstore",
        lambda ch: kvstore_pb2_grpc.KVStoreStub(ch).PurgeWriter(
            kvstore_pb2.PurgeWriterRequest(writer="spiffe://pdserve/worker/decode0"), timeout=5
        ),
    ),
    (
        "router",
        "router",
        lambda ch: router_pb2_grpc.RegistryStub(ch).Register(
            router_pb2.RegisterRequest(instance_id="fake", address="127.0.0.1:1"), timeout=5
        ),
    ),
    (
        "admin",
        "router",
        lambda ch: router_pb2_grpc.RegistryStub(ch).Deregister(
            router_pb2.DeregisterRequest(instance_id="fake"), timeout=5
        ),
    ),
]


@pytest.mark.parametrize("case", range(len(WRONG_ROLE)))
def test_wrong_role_is_permission_denied(cluster, case):
    cert, target, call = WRONG_ROLE[case]
    with cluster.internal_channel(target, as_name=cert) as ch:
        with pytest.raises(grpc.RpcError) as info:
            call(ch)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value.details()
    assert "may not call" in info.value.details()
    assert _serving(cluster) == 2


def test_instance_id_belongs_to_its_registrant(cluster):
    """A valid worker certificate cannot take over, heartbeat for or deregister another
    worker's instance id; the cluster keeps serving from the real instance."""
    status = _status(cluster)
    real = next(i for i in status.instances if i.role == common_pb2.ROLE_PREFILL)
    with cluster.internal_channel("router", as_name="intruder") as ch:
        reg = router_pb2_grpc.RegistryStub(ch)
        calls = {
            "register": lambda: reg.Register(
                router_pb2.RegisterRequest(
                    instance_id=real.instance_id,
                    address="127.0.0.1:1",
                    role=common_pb2.ROLE_PREFILL,
                    model_fingerprint=real.model_fingerprint,
                    block_size=16,
                ),
                timeout=5,
            ),
            "heartbeat": lambda: reg.Heartbeat(
                router_pb2.HeartbeatRequest(instance_id=real.instance_id, state="draining"),
                timeout=5,
            ),
            "deregister": lambda: reg.Deregister(
                router_pb2.DeregisterRequest(instance_id=real.instance_id), timeout=5
            ),
        }
        for what, call in calls.items():
            assert _code(call) == grpc.StatusCode.PERMISSION_DENIED, what
    after = {i.instance_id: i for i in _status(cluster).instances}
    assert after[real.instance_id].address == real.address
    assert after[real.instance_id].state == "serving"
    out = _generate(cluster, _gen_request([5, 6, 7, 8]))
    assert sum(len(r.token_ids) for r in out) == 4


# ------------------------------------------------------------------------ honest cluster


def test_honest_cluster_exact_tokens_under_tls(cluster, reference_engine):
    requests = mixed_requests(10, seed=9)
    expected = reference_tokens(reference_engine, requests)
    for (prompt, max_tokens), want in zip(requests, expected, strict=True):
        sampling = common_pb2.SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        out = _generate(cluster, _gen_request(prompt, sampling=sampling))
        got = [t for r in out for t in r.token_ids]
        assert got == want


# ------------------------------------------------------------------------ bounded input


def test_10mb_prompt_refused_at_once_while_a_normal_request_completes(cluster, reference_engine):
    prompt = list(range(3, 60))
    want = reference_tokens(reference_engine, [(prompt, 40)])[0]
    sampling = common_pb2.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    normal: dict = {}

    def run_normal() -> None:
        out = _generate(cluster, _gen_request(prompt, sampling=sampling))
        normal["tokens"] = [t for r in out for t in r.token_ids]

    thread = threading.Thread(target=run_normal)
    thread.start()
    big = router_pb2.GenerateRequest(text="a" * (10 * 1024 * 1024), sampling=GREEDY)
    t0 = time.perf_counter()
    with pytest.raises(grpc.RpcError) as info:
        _generate(cluster, big)
    elapsed = time.perf_counter() - t0
    thread.join(60)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "characters" in info.value.details()
    print(f"10 MB prompt refused in {elapsed * 1000:.0f} ms")
    assert elapsed < 10.0  # a hang guard; the figure itself is in docs/SECURITY.md
    assert normal["tokens"] == want
    assert _serving(cluster) == 2


def test_chat_and_stop_limits(cluster):
    many = router_pb2.GenerateRequest(sampling=GREEDY)
    for _ in range(300):
        many.chat.messages.add(role="user", content="hi")
    stops = common_pb2.SamplingParams(max_tokens=4, stop=["x" * 300])
    cases = {"chat": many, "stop": _gen_request([5, 6], sampling=stops)}
    for field, req in cases.items():
        with pytest.raises(grpc.RpcError) as info:
            _generate(cluster, req)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in info.value.details()


# ------------------------------------------------------------------------ ids and bodies


@pytest.mark.parametrize(
    "rid", ["héllo", "bad\nid", "tab\tid", "a" * 8192, "spaces are bad", "x" * 129]
)
def test_bad_request_ids_are_invalid_argument(cluster, rid):
    with pytest.raises(grpc.RpcError) as info:
        _generate(cluster, _gen_request([5, 6, 7], rid=rid))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "request_id" in info.value.details()


def test_duplicate_in_flight_request_id_is_refused_and_the_first_is_untouched(cluster):
    sampling = common_pb2.SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(cluster.addr) as ch:
        stub = router_pb2_grpc.RouterStub(ch)
        first = stub.Generate(_gen_request([5, 6, 7], rid="dup-1", sampling=sampling), timeout=60)
        head = next(first)  # the first request is streaming now
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(_gen_request([9, 9], rid="dup-1"), timeout=30))
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        rest = list(first)
    tokens = [t for r in [head, *rest] for t in r.token_ids]
    assert len(tokens) == 200
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    # once finished, the id is free again
    assert sum(len(r.token_ids) for r in _generate(cluster, _gen_request([5], rid="dup-1"))) == 4


def test_undecodable_bodies_are_invalid_argument(cluster):
    bodies = {
        "truncated": b"\x0a\x05ab",
        "invalid utf-8 in a string field": b"\x0a\x02\xff\xfe",
        "bad wire type": b"\x0f\x01",
    }
    with grpc.insecure_channel(cluster.addr) as ch:
        call = ch.unary_stream(
            "/pdserve.v1.Router/Generate",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        for what, body in bodies.items():
            with pytest.raises(grpc.RpcError) as info:
                list(call(body, timeout=10))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    with cluster.internal_channel("decode0", as_name="router") as ch:
        call = ch.unary_stream(
            "/pdserve.v1.Worker/Decode",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(call(b"\x0a\x02\xff\xfe", timeout=10))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    router_log = (cluster.log_dir / "router.log").read_text()
    assert "Traceback" not in router_log


@pytest.mark.parametrize("lease", [math.nan, math.inf, -math.inf, -1.0, 1e308])
def test_bad_lease_is_invalid_argument_and_leaks_nothing(cluster, lease):
    with cluster.internal_channel("decode0", as_name="router") as ch:
        req = worker_pb2.DecodeRequest(
            request_id="lease-1",
            prompt_token_ids=list(range(8)),
            sampling=common_pb2.SamplingParams(max_tokens=4),
            lease_s=lease,
        )
        with pytest.raises(grpc.RpcError) as info:
            list(worker_pb2_grpc.WorkerStub(ch).Decode(req, timeout=10))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lease_s" in info.value.details()
    wait_until(lambda: pool_idle(cluster, "decode0"), 10, "decode pool idle")


# ------------------------------------------------------------------------ kvstore writers


def test_kvstore_puts_are_bound_to_their_writer(cluster, capsys):
    from pdserve.cli.main import main

    """A put begun by one worker cannot be committed by another; an operator can purge a
    writer's blocks (the honest traffic above wrote some)."""
    hashes = [bytes([i]) * 16 for i in range(1, 3)]
    with cluster.internal_channel("kvstore", as_name="worker") as ch:
        begun = kvstore_pb2_grpc.KVStoreStub(ch).BeginPut(
            kvstore_pb2.BeginPutRequest(
                namespace="sec-test", block_hashes=hashes, bytes_per_block=4096
            ),
            timeout=5,
        )
    assert begun.num_accepted == 2
    with cluster.internal_channel("kvstore", as_name="intruder") as ch:
        with pytest.raises(grpc.RpcError) as info:
            kvstore_pb2_grpc.KVStoreStub(ch).CommitPut(
                kvstore_pb2.CommitPutRequest(put_id=begun.put_id, checksums=[b"c" * 16] * 2),
                timeout=10,
            )
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED

    with cluster.internal_channel("kvstore", as_name="admin") as ch:
        kv = kvstore_pb2_grpc.KVStoreStub(ch)
        before = kv.Stats(kvstore_pb2.StatsRequest(), timeout=5).num_blocks
        print(f"kvstore blocks before the purge: {before}")
        assert before > 0, "the honest traffic stored nothing"
        resp = kv.PurgeWriter(
            kvstore_pb2.PurgeWriterRequest(writer="spiffe://pdserve/worker/decode0"), timeout=5
        )
        removed = resp.num_blocks
        # the operator's command line, for the other writer
        argv = ["kvstore", "purge-writer", "--addr", f"127.0.0.1:{cluster.kvstore_port}"]
        argv += ["--tls-dir", str(cluster.tls_dir), "spiffe://pdserve/worker/prefill0"]
        capsys.readouterr()
        assert main(argv) == 0
        removed += json.loads(capsys.readouterr().out)["removed_blocks"]
        after = kv.Stats(kvstore_pb2.StatsRequest(), timeout=5).num_blocks
    assert removed == before - after
    assert after == 0, "every stored block was written by prefill0 or decode0"


def test_kv_without_the_ticket_nonce_is_discarded(cluster):
    """A prefill that sends the right tags but not the ticket's nonce (what a stray UCX
    sender that guessed the tags would do) gets nothing admitted; the decode counts it and
    frees the reservation."""
    from .conftest import counter

    prompt = list(range(3, 43))
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    before = counter(cluster, "decode0", "decode_nonce_mismatch")
    with (
        cluster.internal_channel("decode0", as_name="router") as dch,
        cluster.internal_channel("prefill0", as_name="router") as pch,
    ):
        dec, pre = worker_pb2_grpc.WorkerStub(dch), worker_pb2_grpc.WorkerStub(pch)
        stream = dec.Decode(
            worker_pb2.DecodeRequest(
                request_id="nonce-1", prompt_token_ids=prompt, sampling=sampling, lease_s=20.0
            ),
            timeout=30,
        )
        ticket = next(stream).ticket
        assert len(ticket.nonce) == 16
        forged = worker_pb2.Ticket()
        forged.CopyFrom(ticket)
        forged.nonce = bytes(16)
        pre.Prefill(
            worker_pb2.PrefillRequest(
                request_id="nonce-1", token_ids=prompt, sampling=sampling, ticket=forged
            ),
            timeout=30,
        )
        wait_until(
            lambda: counter(cluster, "decode0", "decode_nonce_mismatch") > before, 10, "mismatch"
        )
        with pytest.raises(grpc.RpcError) as info:
            list(stream)  # the stream ends with the discarded KV
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_until(lambda: pool_idle(cluster, "decode0"), 10, "decode pool idle")
