"""Router replicas: two routers sharing a real Redis, every
worker registered with both, under the launcher's Supervisor (what `pdserve up --routers 2`
runs). A router killed with SIGKILL mid-stream: every SDK stream resumes on the other
replica with the in-process engine's tokens (greedy and seeded), the supervisor restarts
the router, which re-learns every worker; no KV block is left held. Also: each replica's
Status lists both routers and every worker; a key's concurrency limit holds across the
replicas; one flip leader; a replica that does not know a worker routes around it; bad
resumes (another key, an unknown or finished stream, nothing received) get clear errors
and nothing breaks. Every wait is bounded (hang guards, not timing claims)."""

from __future__ import annotations

import asyncio
import json
import random
import signal

import grpc
import pytest

from pdserve.workload.requests import greedy_and_seeded_streams

from .conftest import VOCAB, engine_tokens, pool_idle, start_cluster, wait_until
from .replica_streams import (
    RouterKiller,
    divergence,
    flip_leaders,
    serves_every_worker,
    streams_until,
)

pytestmark = pytest.mark.integration

N_STREAMS = 16
LONG_CONTEXT = 1024
MAX_TOKENS = 400
KEY_LIMIT = 6  # key "alpha": concurrent streams across both replicas
WORKER_ARGS = ["--num-blocks", "2048", "--max-num-batched-tokens", "512"]
KEYS = {
    "keys": [
        {"name": "alpha", "key": "sk-alpha", "max_concurrent": KEY_LIMIT},
        {"name": "beta", "key": "sk-beta"},
    ]
}


def _requests(seed: int, n: int = N_STREAMS, max_tokens: int = MAX_TOKENS) -> list[dict]:
    return greedy_and_seeded_streams(n, max_tokens, VOCAB, seed)


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    from pdserve.model.tiny import TinySpec, make_tiny

    root = tmp_path_factory.mktemp("replicas-tiny")
    return make_tiny(root / "llama", TinySpec(vocab=VOCAB, max_pos=LONG_CONTEXT))


@pytest.fixture(scope="module")
def long_reference(long_model_dir):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=str(long_model_dir), dtype="float32", num_blocks=2048))


@pytest.fixture(scope="module")
def replicas(long_model_dir, tmp_path_factory):
    from pdserve.supervisor import RestartPolicy, Supervisor, SupervisorThread

    keys = tmp_path_factory.mktemp("replica-keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    cluster = start_cluster(
        long_model_dir,
        routers=2,
        prefill=1,
        decode=1,
        kvstore=True,
        http_port=0,
        api_key="sk-beta",
        worker_args=WORKER_ARGS,
        router_args=["--api-keys-file", str(keys), "--flip-enabled", "--flip-interval-s", "0.5"],
    )
    said: list[str] = []
    supervisor = Supervisor(cluster, RestartPolicy(initial_s=0.2, max_s=2.0), said.append)
    try:
        with SupervisorThread(supervisor):
            yield cluster, supervisor, said
    finally:
        cluster.stop()


def _status(addr: str, key: str = "sk-beta"):
    from pdserve.client import Client

    with Client(addr, api_key=key, max_retries=0) as client:
        return client.status(timeout=5)


@pytest.fixture
def serving(replicas):
    """`replicas` once every router serves and knows every worker: a test starts whole even
    when the one before it failed with a router still restarting."""
    cluster = replicas[0]
    for addr in cluster.addrs:
        wait_until(
            lambda addr=addr: serves_every_worker(cluster, addr, _status),
            60,
            f"{addr} serves and knows every worker",
        )
    return replicas


def test_each_replica_knows_both_routers_and_every_worker(serving):
    cluster, _supervisor, _said = serving
    assert len(cluster.addrs) == 2 and len(cluster.http_urls) == 2
    for addr in cluster.addrs:
        st = _status(addr)
        assert {i.role for i in st.instances} == {"prefill", "decode"}

        def both(addr=addr) -> bool:  # every worker reports both routers (a heartbeat away)
            routers = _status(addr).routers
            return len(routers) == 2 and all(r.workers == 2 for r in routers)

        wait_until(both, 10, f"{addr} sees 2 routers, each reported by both workers")
        st = _status(addr)
        assert sorted(r.address for r in st.routers) == sorted(cluster.addrs)
        assert [r.address for r in st.routers if r.is_self] == [addr]
        assert st.shared_store == "redis up"
    # one flip leader among the replicas
    gained = flip_leaders(cluster)
    assert len(gained) == 1, gained


def test_streams_survive_a_killed_router(serving, long_reference):
    cluster, supervisor, said = serving
    requests = _requests(seed=1)
    for i, r in enumerate(requests):
        r["request_id"] = f"survive-{i}"  # (named in the logs a failure points to)
    expected = engine_tokens(long_reference, requests)
    killer = RouterKiller(cluster, _status)
    results = asyncio.run(streams_until(cluster.addrs, requests, killer))
    failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failures, f"client-visible failures: {failures[:3]}"
    wrong = {
        f"survive-{i}": divergence(r[0], e, killer.at_kill[i])
        for i, (r, e) in enumerate(zip(results, expected, strict=True))
        if r[0] != e
    }
    assert not wrong, f"wrong tokens (logs: {cluster.log_dir}): {wrong}"
    assert all(finish == "length" for _t, finish, _x in results)
    victim = killer.victim
    # Resumed on a live router: the survivor, or (if the SDK met the survivor busy or failing
    # under load) the victim once restarted; each process's log is its own file (a restart
    # starts a fresh one), so the dead process's log holds none of them.
    resumed = sum(
        "stream resumed" in cluster.processes[n].log_path.read_text()
        for n in cluster.router_names()
    )
    assert resumed, "no stream was resumed on a live router"

    # New requests reach the survivor at once, on both doors.
    survivor = next(n for n in cluster.router_names() if n != victim)
    port, _internal, http = cluster.router_ports[survivor]
    from pdserve.client import Client

    with Client(f"127.0.0.1:{port}", api_key="sk-beta", max_retries=0) as client:
        assert (
            len(client.generate(token_ids=[3, 4, 5], max_tokens=4, ignore_eos=True).token_ids) == 4
        )
    import httpx

    auth = {"authorization": "Bearer sk-beta"}
    url = f"http://127.0.0.1:{http}/v1"
    model = httpx.get(f"{url}/models", headers=auth, timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": [3, 4, 5], "max_tokens": 4, "ignore_eos": True}
    resp = httpx.post(f"{url}/completions", json=body, timeout=30, headers=auth)
    assert resp.status_code == 200, resp.text

    # The supervisor restarts the router on its ports; it re-learns every worker.
    wait_until(lambda: supervisor.restarts.get(victim, 0) == 1, 30, "router restarted")
    addr = f"127.0.0.1:{cluster.router_ports[victim][0]}"
    wait_until(
        lambda: serves_every_worker(cluster, addr, _status),
        60,
        "the restarted router knows every worker",
    )
    assert sum("exited with code -9" in line for line in said) == 1
    # The decode whose router died freed the streams' blocks: nothing held anywhere.
    for name in cluster.worker_names():
        wait_until(lambda name=name: pool_idle(cluster, name), 30, f"{name} idle")


def _raw_stream(addr: str, key: str, req: dict, n_tokens: int):
    """Generate on one router with the raw stub: (request, tokens, text, resume_token)
    after at least `n_tokens` tokens (the call is then cancelled)."""
    from pdserve.client.aio import build_request
    from pdserve.v1 import router_pb2_grpc

    request = build_request(request_id=f"raw-{random.randrange(1 << 30)}", **req)
    tokens, text, token = [], [], ""
    with grpc.insecure_channel(addr) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(
            request, timeout=60, metadata=(("authorization", f"Bearer {key}"),)
        )
        for msg in call:
            token = msg.resume_token or token
            tokens += msg.token_ids
            text.append(msg.text)
            if len(tokens) >= n_tokens:
                call.cancel()
                break
    return request, tokens, "".join(text), token


def _resume(addr: str, key: str, request, tokens, token, text=""):
    from pdserve.v1 import router_pb2, router_pb2_grpc

    resume = router_pb2.ResumeRequest(
        request=request, received_token_ids=tokens, resume_token=token, received_text=text
    )
    with grpc.insecure_channel(addr) as ch:
        out = []
        for msg in router_pb2_grpc.RouterStub(ch).Resume(
            resume, timeout=60, metadata=(("authorization", f"Bearer {key}"),)
        ):
            out += msg.token_ids
        return out


def test_bad_resumes_get_clear_errors_and_lose_nothing(serving, long_reference):
    cluster, _supervisor, _said = serving
    a, b = cluster.addrs
    # long: a busy router merges tokens into fewer messages, and the cut after >= 10 tokens
    # must still leave tokens owed
    req = _requests(seed=7, n=1, max_tokens=MAX_TOKENS)[0]
    [expected] = engine_tokens(long_reference, [req])
    request, tokens, text, token = _raw_stream(a, "sk-alpha", req, 10)
    assert token and tokens == expected[: len(tokens)] and len(tokens) < len(expected)

    def code_of(fn) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as info:
            fn()
        return info.value.code(), info.value.details()

    code, details = code_of(lambda: _resume(b, "sk-beta", request, tokens, token))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "another API key" in details
    forged = token[:-4] + "AAAA"
    code, details = code_of(lambda: _resume(b, "sk-alpha", request, tokens, forged))
    assert code == grpc.StatusCode.NOT_FOUND and "unknown stream" in details
    other = type(request)()
    other.CopyFrom(request)
    other.request_id = "never-started"
    code, _ = code_of(lambda: _resume(b, "sk-alpha", other, tokens, token))
    assert code == grpc.StatusCode.NOT_FOUND
    code, details = code_of(lambda: _resume(b, "sk-alpha", request, expected, token))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "already finished" in details
    code, details = code_of(lambda: _resume(b, "sk-alpha", request, [], token))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "received_token_ids" in details
    # ... and the right one continues the stream on the other replica, token-exact
    rest = _resume(b, "sk-alpha", request, tokens, token, text)
    assert tokens + rest == expected
    for name in cluster.worker_names():
        wait_until(lambda name=name: pool_idle(cluster, name), 30, f"{name} idle")


def test_key_limit_holds_across_replicas(serving):
    """Key alpha may run KEY_LIMIT streams in all: 2 x KEY_LIMIT started on two replicas
    at once, at most KEY_LIMIT (+1 per replica, the documented bound) run, the rest get
    RESOURCE_EXHAUSTED naming the replicas."""
    cluster, _supervisor, _said = serving
    from pdserve.client import AsyncClient, ResourceExhausted

    async def run() -> list:
        clients = [AsyncClient(a, api_key="sk-alpha", max_retries=0) for a in cluster.addrs]
        reqs = _requests(seed=3, n=2 * KEY_LIMIT, max_tokens=200)
        try:
            return await asyncio.gather(
                *(clients[i % 2].generate(**r) for i, r in enumerate(reqs)),
                return_exceptions=True,
            )
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(run())
    ok = [r for r in results if not isinstance(r, BaseException)]
    refused = [r for r in results if isinstance(r, ResourceExhausted)]
    assert len(ok) + len(refused) == len(results), [r for r in results if r not in ok]
    assert KEY_LIMIT // 2 < len(ok) <= KEY_LIMIT + 2  # a local-only limit would admit 2x
    assert all("across the router replicas" in e.message for e in refused)


def test_a_replica_routes_around_a_worker_it_cannot_reach(serving, long_model_dir):
    """A decode registered with one replica only (its link to the other is cut): the other
    replica never sends it work and serves every request on the decode it knows."""
    import subprocess
    import sys

    cluster, _supervisor, _said = serving
    a_internal, _b_internal = cluster.internal_addrs
    log = cluster.log_dir / "decode-partitioned.log"
    argv = [
        sys.executable, "-m", "pdserve.worker", "--port", "0", "--role", "decode",
        "--model", str(long_model_dir), "--router-addr", a_internal,
        "--no-insecure", "--tls-dir", str(cluster.tls_dir), "--tls-name", "worker", *WORKER_ARGS,
    ]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        a, b = cluster.addrs

        def registered() -> bool:
            assert proc.poll() is None, log.read_text()[-2000:]
            return len(_status(a).instances) == 3

        wait_until(registered, 90, "the extra decode registered")
        extra = {i.instance_id for i in _status(a).instances} - {
            i.instance_id for i in _status(b).instances
        }
        assert len(extra) == 1
        from pdserve.client import Client

        with Client(b, api_key="sk-beta", max_retries=0) as client:
            for r in _requests(seed=5, n=6, max_tokens=8):
                res = client.generate(**r)
                assert len(res.token_ids) == 8 and res.usage.decode_instance not in extra
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
