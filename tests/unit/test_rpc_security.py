"""Security building blocks without a network: certificates and identities, the
authorization table, TLS settings, id rules, registry ownership, input limits, worker field
checks, and the kvstore's purge by writer."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest

from pdserve.errors import InvalidRequestError, PermissionDeniedError
from pdserve.rpc.authz import authorize
from pdserve.rpc.certs import Identity, identity_of_pem, make_cert, make_dev_pki, san_hosts
from pdserve.rpc.ids import check_id, is_valid_id
from pdserve.rpc.tls import TlsConfigError, TlsFiles, files_from_settings

# --------------------------------------------------------------------------- certificates


def test_dev_pki_names_each_holder_in_a_spiffe_uri(tmp_path):
    made = make_dev_pki(tmp_path)
    assert [i.uri for i in made] == [
        "spiffe://pdserve/router/router",
        "spiffe://pdserve/kvstore/kvstore",
        "spiffe://pdserve/worker/worker",
        "spiffe://pdserve/admin/admin",
    ]
    for ident in made:
        assert identity_of_pem((tmp_path / f"{ident.name}.crt").read_bytes()) == ident
    assert (tmp_path / "ca.key").stat().st_mode & 0o077 == 0  # private keys: owner only
    ca_before = (tmp_path / "ca.crt").read_bytes()
    make_cert(tmp_path, "worker", "prefill0")  # reuses the CA
    assert (tmp_path / "ca.crt").read_bytes() == ca_before
    assert TlsFiles.in_dir(tmp_path, "prefill0").identity() == Identity("worker", "prefill0")


@pytest.mark.parametrize("role, name", [("root", "x"), ("worker", "a/b"), ("worker", "")])
def test_bad_role_or_name_is_refused(tmp_path, role, name):
    with pytest.raises(ValueError):
        make_cert(tmp_path, role, name)


def test_certificates_name_their_hosts(tmp_path):
    """A multi-host layout: each certificate names the address (or DNS name) of its host,
    besides the cluster name every client verifies; `common_hosts` go into every one."""
    make_dev_pki(
        tmp_path,
        [("worker", "decode0"), ("router", "router")],
        hosts={"decode0": ["10.77.0.40", "Decode0.example", "10.77.0.40"]},
        common_hosts=["fd00::7"],
    )
    decode = san_hosts((tmp_path / "decode0.crt").read_bytes())
    router = san_hosts((tmp_path / "router.crt").read_bytes())
    assert decode.count("10.77.0.40") == 1 and "decode0.example" in decode
    assert {"pdserve.internal", "127.0.0.1", "fd00::7"} <= set(decode)
    assert "10.77.0.40" not in router and "fd00::7" in router


@pytest.mark.parametrize("host", ["bad_host", "-x.example", "a..b", "", "x" * 254])
def test_a_host_that_is_no_address_or_dns_name_is_refused(tmp_path, host):
    with pytest.raises(ValueError, match="IP address or a DNS name"):
        make_cert(tmp_path, "worker", "w", hosts=[host])
    assert not (tmp_path / "w.crt").exists()


def test_certs_make_names_hosts_from_the_command_line(tmp_path, capsys):
    from pdserve.cli.main import main

    out = tmp_path / "certs"
    rc = main(
        ["certs", "make", str(out), "--service", "worker:prefill0@10.77.0.20,p0.internal",
         "--service", "admin:admin", "--san", "10.77.0.99"]
    )  # fmt: skip
    assert rc == 0
    assert {"10.77.0.20", "p0.internal", "10.77.0.99"} <= set(
        san_hosts((out / "prefill0.crt").read_bytes())
    )
    assert "10.77.0.20" not in san_hosts((out / "admin.crt").read_bytes())
    assert "(10.77.0.20, p0.internal, 10.77.0.99)" in capsys.readouterr().out
    assert main(["certs", "make", str(out), "--service", "worker:p1@"]) == 2
    assert main(["certs", "make", str(out), "--service", "worker:p1@no_such host"]) == 2
    assert "IP address or a DNS name" in capsys.readouterr().err


@pytest.mark.parametrize(
    "uri, ok",
    [
        ("spiffe://pdserve/worker/w1", True),
        ("spiffe://pdserve/router/router", True),
        ("spiffe://other/worker/w1", False),
        ("spiffe://pdserve/god/w1", False),
        ("spiffe://pdserve/worker/", False),
        ("spiffe://pdserve/worker/a/b", False),
    ],
)
def test_identity_from_uri(uri, ok):
    assert (Identity.from_uri(uri) is not None) == ok


# --------------------------------------------------------------------------- authorization

W, R, A, K = (Identity(r, "x") for r in ("worker", "router", "admin", "kvstore"))


@pytest.mark.parametrize(
    "method, allowed, denied",
    [
        ("/pdserve.v1.Registry/Register", [W], [R, A, K]),
        ("/pdserve.v1.Worker/Decode", [R], [W, A, K]),
        ("/pdserve.v1.Worker/SetRole", [R], [W, A, K]),
        ("/pdserve.v1.Worker/Info", [R, A], [W, K]),
        ("/pdserve.v1.KVStore/BeginPut", [W], [R, A, K]),
        ("/pdserve.v1.KVStore/PurgeWriter", [A], [W, R, K]),
        ("/pdserve.v1.KVStore/SomethingNew", [A], [W, R, K]),  # service fallback
        ("/pdserve.v1.Worker/SomethingNew", [R], [W, A, K]),
        ("/grpc.health.v1.Health/Check", [W, R, A, K], []),
        ("/some.Other/Method", [], [W, R, A, K]),
    ],
)
def test_authorization_table(method, allowed, denied):
    for peer in allowed:
        assert authorize(method, peer) is None, (method, peer)
    for peer in denied:
        reason = authorize(method, peer)
        assert reason is not None and peer.role in reason
    assert "no pdserve client certificate" in authorize(method, None)


# --------------------------------------------------------------------------- TLS settings


def _settings(**kw):
    base = dict(
        insecure=False, tls_dir=None, tls_name=None, tls_ca_file=None, tls_cert_file=None,
        tls_key_file=None,
    )  # fmt: skip
    return SimpleNamespace(**{**base, **kw})


def test_tls_settings(tmp_path):
    make_dev_pki(tmp_path)
    assert files_from_settings(_settings(insecure=True), "router") is None
    files = files_from_settings(_settings(tls_dir=str(tmp_path)), "router")
    assert files == TlsFiles.in_dir(tmp_path, "router")
    files = files_from_settings(_settings(tls_dir=str(tmp_path), tls_name="admin"), "router")
    assert files.cert.name == "admin.crt"
    with pytest.raises(TlsConfigError, match="--insecure"):
        files_from_settings(_settings(), "router")  # nothing configured: refuse
    with pytest.raises(TlsConfigError, match="contradicts"):
        files_from_settings(_settings(insecure=True, tls_dir=str(tmp_path)), "router")
    with pytest.raises(TlsConfigError, match="go together"):
        files_from_settings(_settings(tls_ca_file=str(tmp_path / "ca.crt")), "router")
    with pytest.raises(TlsConfigError, match="not found"):
        files_from_settings(_settings(tls_dir=str(tmp_path), tls_name="nobody"), "router")


def test_service_settings_take_tls_flags():
    from pdserve.config import load_settings
    from pdserve.worker.settings import WorkerSettings

    s = load_settings(
        WorkerSettings, ["--tls-dir", "/c", "--tls-name", "w1", "--no-insecure"],
        exit_on_error=False,
    )  # fmt: skip
    assert (s.tls_dir, s.tls_name, s.insecure) == ("/c", "w1", False)


# --------------------------------------------------------------------------- ids


@pytest.mark.parametrize(
    "value, ok",
    [
        ("abc-123_x.y:z", True),
        ("a" * 128, True),
        ("a" * 129, False),
        ("", False),
        ("héllo", False),
        ("bad\nid", False),
        ("sp ace", False),
    ],
)
def test_id_rule(value, ok):
    assert is_valid_id(value) == ok
    if not ok and value:
        with pytest.raises(InvalidRequestError) as info:
            check_id("request_id", value)
        assert value not in str(info.value)  # the bad value is not echoed
    assert check_id("x", "", required=False) == ""


# --------------------------------------------------------------------------- registry owners


def test_instance_id_belongs_to_its_registrant(monkeypatch):
    from pdserve.router.cluster import registry_checks

    owners = registry_checks.Owners()
    peer = {"who": Identity("worker", "a")}
    monkeypatch.setattr(registry_checks, "current_peer", lambda: peer["who"])
    owners.check("i1", known=False)
    owners.claim("i1")
    owners.check("i1", known=True)  # the same identity: fine
    peer["who"] = Identity("worker", "b")
    with pytest.raises(PermissionDeniedError):
        owners.check("i1", known=True)
    owners.check("i1", known=False)  # forgotten by the registry: the id is free again
    owners.claim("i1")
    owners.check("i1", known=True)


def test_instances_per_identity_cap(monkeypatch):
    from pdserve.errors import OverloadedError
    from pdserve.router.cluster import registry_checks

    owners = registry_checks.Owners(max_per_identity=1)
    peer = {"who": Identity("worker", "a")}
    monkeypatch.setattr(registry_checks, "current_peer", lambda: peer["who"])
    owners.check_quota("i1", live=set())
    owners.claim("i1")
    owners.check_quota("i1", live={"i1"})  # re-registering its own instance: fine
    with pytest.raises(OverloadedError, match="max_instances_per_identity"):
        owners.check_quota("i2", live={"i1"})
    owners.check_quota("i2", live=set())  # i1 expired: room again
    peer["who"] = Identity("worker", "b")
    owners.check_quota("i3", live={"i1"})  # another identity has its own quota
    assert registry_checks.Owners().max_per_identity == 0  # default: no cap


# --------------------------------------------------------------------------- input limits


def test_public_limits_refuse_before_tokenizing():
    from pdserve.router.frontdoor.input_limits import InputLimits, check_raw_request
    from pdserve.v1 import router_pb2

    lim = InputLimits(max_prompt_chars=100, max_chat_messages=2, max_prompt_tokens=8)
    cases = {
        "characters": router_pb2.GenerateRequest(text="x" * 101),
        "messages": router_pb2.GenerateRequest(),
        "max_prompt_tokens": router_pb2.GenerateRequest(),
    }
    for _ in range(3):
        cases["messages"].chat.messages.add(role="user", content="hi")
    cases["max_prompt_tokens"].token_ids.ids.extend(range(9))
    for word, req in cases.items():
        with pytest.raises(InvalidRequestError, match=word):
            check_raw_request(req, lim)
    check_raw_request(router_pb2.GenerateRequest(text="x" * 100), lim)


# --------------------------------------------------------------------------- worker checks


@pytest.mark.parametrize("lease", [math.nan, math.inf, -math.inf, -1.0, 1e308, 601.0])
def test_lease_bounds(lease):
    from pdserve.v1 import common_pb2, worker_pb2
    from pdserve.worker.checks import WorkerLimits, check_decode

    lim = WorkerLimits(vocab_size=100, max_model_len=64, block_size=16, max_lease_s=600.0)
    sp = common_pb2.SamplingParams(max_tokens=4)
    ok = worker_pb2.DecodeRequest(
        request_id="r", prompt_token_ids=[1, 2, 3, 4], sampling=sp, lease_s=30.0
    )
    check_decode(ok, lim)
    bad = worker_pb2.DecodeRequest(
        request_id="r", prompt_token_ids=[1, 2, 3, 4], sampling=sp, lease_s=lease
    )
    with pytest.raises(InvalidRequestError, match="lease_s"):
        check_decode(bad, lim)
    with pytest.raises(InvalidRequestError, match="sampling"):
        check_decode(worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1]), lim)


def test_ticket_checks():
    from pdserve.v1 import common_pb2, worker_pb2
    from pdserve.worker.checks import WorkerLimits, check_prefill

    lim = WorkerLimits(vocab_size=100, max_model_len=64, block_size=16, max_lease_s=600.0)

    def req(**ticket):
        t = dict(ticket_id=5 << 16, tag_base=5 << 16, ucx_worker_address=b"a", num_blocks=2)
        return worker_pb2.PrefillRequest(
            request_id="r", token_ids=list(range(20)), ticket=worker_pb2.Ticket(**{**t, **ticket})
        )

    check_prefill(req(), lim)
    for field, bad in [
        ("tag_base", dict(tag_base=(5 << 16) + 1)),
        ("tag_base", dict(tag_base=0)),
        ("num_blocks", dict(num_blocks=3)),
        ("ucx_worker_address", dict(ucx_worker_address=b"")),
        ("lease_expiry", dict(lease_expiry_unix_s=math.nan)),
    ]:
        with pytest.raises(InvalidRequestError, match=field):
            check_prefill(req(**bad), lim)
    # no ticket: only for a 1-token request (prefill only, no KV leaves the worker)
    one = worker_pb2.PrefillRequest(
        request_id="r", token_ids=[1, 2], sampling=common_pb2.SamplingParams(max_tokens=1)
    )
    check_prefill(one, lim)
    for max_tokens in (0, 2):
        one.sampling.max_tokens = max_tokens
        with pytest.raises(InvalidRequestError, match="ticket: must be set unless"):
            check_prefill(one, lim)


# --------------------------------------------------------------------------- kvstore writers


def test_purge_writer_drops_its_blocks_and_everything_chained_after():
    from pdserve.kv.hashing import block_hashes
    from pdserve.kvstore.store import BlockStore, checksum

    nbytes = 1024
    store = BlockStore(1 << 20, nbytes)

    def put(hashes, writer, first=0):
        res = store.begin_put("ns", hashes, first, nbytes, writer)
        data = np.zeros(len(res.slots) * nbytes, np.uint8)
        sums = [checksum(data[i * nbytes : (i + 1) * nbytes]) for i in range(len(res.slots))]
        assert store.write_put(res, data, sums)
        return store.commit_put(res.put_id, sums)

    shared = block_hashes(list(range(16)), 4, "ns")  # 4 blocks
    other = block_hashes(list(range(100, 108)), 4, "ns")  # 2 unrelated blocks
    assert put(shared[:2], "evil") == 2
    assert put(shared, "honest") == 2  # blocks 2-3 chained after evil's
    assert put(other, "honest") == 2
    assert store.admin.blocks_by_writer() == {"evil": 2, "honest": 4}
    removed, in_use = store.admin.purge_writer("evil")
    assert (removed, in_use) == (4, 0)
    assert store.lookup("ns", shared) == 0 and store.lookup("ns", other) == 2
    store.check_integrity()


# --------------------------------------------------------------------------- the runner


async def test_a_service_without_tls_material_refuses_to_start():
    from pdserve.config import ServiceSettings
    from pdserve.rpc.server import ServiceApp, ServiceRunner

    class App(ServiceApp):
        name = "toy"

        async def start(self, server) -> None:
            pass

    runner = ServiceRunner(App(), ServiceSettings(port=0, insecure=False))
    with pytest.raises(OSError, match="no TLS material"):
        await runner.start()
    assert runner.state == "stopped"


async def test_bench_tls_measures_both_arms():
    from pdserve.bench.tls import run

    res = await run(calls=3, chunks=10, rounds=1)
    for arm in ("plaintext", "mtls"):
        assert res[f"{arm}_unary_us_median"] > 0 and res[f"{arm}_per_chunk_cpu_us_median"] > 0
    assert "mtls_extra_per_chunk_cpu_us" in res


def test_ticket_nonce_roundtrip():
    from pdserve.worker.nonce import new_nonce, nonce_matches, token_buffer, token_message

    nonce = new_nonce()
    msg = token_message(42, nonce)
    assert int(msg[0]) == 42 and nonce_matches(msg, nonce)
    assert not nonce_matches(msg, new_nonce())
    assert not nonce_matches(token_buffer(), nonce)  # a short message leaves zeros
    assert not nonce_matches(token_message(42, b""), nonce)
    assert not nonce_matches(msg, b"")  # a ticket without a nonce admits nothing


def test_up_insecure_says_so_loudly(monkeypatch, capsys):
    """`pdserve up --insecure` warns before anything starts (the cluster itself is faked:
    it fails to start, which `up` reports)."""
    import pdserve.launcher
    from pdserve.cli.main import build_parser

    seen = {}

    class FakeCluster:
        def __init__(self, config):
            seen["tls"] = config.tls
            self.log_dir = "/nowhere"

        def start(self):
            raise RuntimeError("fake")

        def stop(self):
            pass

    monkeypatch.setattr(pdserve.launcher, "Cluster", FakeCluster)
    monkeypatch.setattr("pdserve.cli.up.signal.signal", lambda *a: None)  # keep pytest's
    args = build_parser().parse_args(["up", "--insecure"])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "INSECURE" in err and "local debugging only" in err and "!" * 20 in err
    assert seen["tls"] is False
    args = build_parser().parse_args(["up"])
    assert args.func(args) == 1
    assert seen["tls"] is True and "INSECURE" not in capsys.readouterr().err
