"""Streams survive a dead decode: 2 prefill + 2 decode worker processes under the
launcher's Supervisor (what `pdserve up` runs), 32 concurrent streams (greedy and seeded), a
decode killed with SIGKILL mid-stream three times. Expected: no client-visible failure, every
stream's tokens identical to the in-process engine's, no KV block leaked on any live worker,
each killed decode restarted by the supervisor and registered again, and the router counted
the migrations. Every wait is bounded (hang guards, not timing claims)."""

from __future__ import annotations

import asyncio
import signal
import socket
import time
import urllib.request

import pytest

from pdserve.workload.requests import greedy_and_seeded_streams

from .conftest import VOCAB, engine_tokens, pool_idle, start_cluster, wait_until, worker_info

pytestmark = pytest.mark.integration

N_STREAMS = 32
# Streams last seconds, so that a kill lands mid-stream even on a slow or busy machine
# (with 200 tokens a colocated wave once ended before the poll found a busy worker): a
# checkpoint of its own with a longer context (prompt <= 48 + MAX_TOKENS <= LONG_CONTEXT).
LONG_CONTEXT = 1024
MAX_TOKENS = 600
WORKER_ARGS = ["--num-blocks", "2048", "--max-num-batched-tokens", "512"]  # all on one: 1.3k
KILLS = 3  # SIGKILLs of a decode, one per wave of streams
MIN_RUNNING_AT_KILL = 4  # kill a decode once it runs at least this many of the streams


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _requests(seed: int, max_tokens: int = MAX_TOKENS) -> list[dict]:
    return greedy_and_seeded_streams(N_STREAMS, max_tokens, VOCAB, seed)


def _migrations(port: int, reason: str = "") -> float:
    """pdserve_router_migrations_total, summed over reasons or for one."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    prefix = "pdserve_router_migrations_total" + (f'{{reason="{reason}"}}' if reason else "")
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(prefix)
    )


def _migration_reasons(port: int) -> dict[str, float]:
    """pdserve_router_migrations_total by reason (for failure messages)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    prefix = 'pdserve_router_migrations_total{reason="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(prefix)
    }


def _registered_ids(addr: str) -> set[str]:
    import grpc

    from pdserve.v1 import router_pb2, router_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        status = router_pb2_grpc.RouterStub(channel).Status(router_pb2.StatusRequest(), timeout=5)
    return {i.instance_id for i in status.instances if i.state == "serving"}


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    from pdserve.model.tiny import TinySpec, make_tiny

    root = tmp_path_factory.mktemp("migration-tiny")
    return make_tiny(root / "llama", TinySpec(vocab=VOCAB, max_pos=LONG_CONTEXT))


@pytest.fixture(scope="module")
def long_reference(long_model_dir):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=str(long_model_dir), dtype="float32", num_blocks=2048))


@pytest.fixture(scope="module")
def supervised(long_model_dir):
    from pdserve.supervisor import RestartPolicy, Supervisor, SupervisorThread

    metrics_port = _free_port()
    cluster = start_cluster(
        long_model_dir,
        prefill=2,
        decode=2,
        worker_args=WORKER_ARGS,
        router_args=[f"--metrics-port={metrics_port}"],
    )
    said: list[str] = []
    supervisor = Supervisor(cluster, RestartPolicy(initial_s=0.2, max_s=2.0), said.append)
    try:
        with SupervisorThread(supervisor):
            yield cluster, supervisor, metrics_port, said
    finally:
        cluster.stop()


async def _run_wave(addr: str, requests: list[dict], kill_when_running) -> list:
    """Run the streams; meanwhile call `kill_when_running()` (in a thread) until it returns
    True (it killed a decode)."""
    from pdserve.client import AsyncClient

    started = [False] * len(requests)

    async def one(client, i: int, req: dict):
        tokens: list[int] = []
        finish = None
        async for ev in client.generate_stream(**req):
            tokens += ev.token_ids
            finish = ev.finish_reason or finish
            started[i] = True
        return tokens, finish

    async with AsyncClient(addr, timeout=120.0, max_retries=0) as client:
        tasks = [asyncio.ensure_future(one(client, i, r)) for i, r in enumerate(requests)]
        try:
            # Every stream has its first token before the kill: then every sequence running
            # on a decode is one whose client is mid-stream, and killing that decode must
            # migrate it. (Before the first token a lost decode is the orchestrator's own
            # prefill retry, which is not a migration.)
            deadline = time.monotonic() + 60
            while not all(started) or not await asyncio.to_thread(kill_when_running):
                assert time.monotonic() < deadline, "the streams never ran on a decode"
                assert not all(t.done() for t in tasks), "every stream ended before the kill"
                await asyncio.sleep(0.02)
            return await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _wave(cluster, metrics_port: int, requests, expected, sig: int, label: str) -> None:
    """Run the streams, hit the busiest decode with `sig` mid-stream, check every stream,
    SIGKILL the victim if it is still there (frozen), wait until the supervisor brought it
    back and registered, and check that no live worker holds a KV block."""
    migrations0 = _migrations(metrics_port)
    hit: list[tuple[str, str, object]] = []  # (name, instance id, its ManagedProcess)

    def hit_when_running() -> bool:
        """Signal the decode running the most streams (its Info load may be a heartbeat
        old, hence the long streams), if it runs several."""
        infos = {n: worker_info(cluster, n) for n in ("decode0", "decode1")}
        victim = max(infos, key=lambda n: infos[n].load.num_running)
        if infos[victim].load.num_running < MIN_RUNNING_AT_KILL:
            return False
        proc = cluster.processes[victim]
        proc.signal(sig)
        hit.append((victim, infos[victim].instance_id, proc))
        return True

    results = asyncio.run(_run_wave(cluster.addr, requests, hit_when_running))
    victim, old_id, proc = hit[0]
    proc.signal(signal.SIGKILL)  # a frozen one: now dead (not its restarted successor)
    failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failures, f"{label}: client-visible failures: {failures[:3]}"
    wrong = [i for i, (r, e) in enumerate(zip(results, expected, strict=True)) if r[0] != e]
    assert not wrong, f"{label}: wrong tokens in streams {wrong}"
    assert all(finish == "length" for _tokens, finish in results)
    assert _migrations(metrics_port) > migrations0, f"{label}: no stream migrated"

    # The supervisor brings the victim back; it registers under a new instance id.
    def back() -> bool:
        proc = cluster.processes[victim]
        if not proc.alive or proc.port is None:
            return False
        try:
            new_id = worker_info(cluster, victim).instance_id
            ids = _registered_ids(cluster.addr)
        except Exception:
            return False
        return new_id != old_id and new_id in ids and old_id not in ids

    wait_until(back, 120, f"{label}: {victim} restarted and registered")
    for name in cluster.worker_names():  # no KV block leaked anywhere
        wait_until(lambda name=name: pool_idle(cluster, name), 30, f"{label}: {name} idle")


def test_streams_survive_a_killed_decode(supervised, long_reference):
    cluster, supervisor, metrics_port, said = supervised
    requests = _requests(seed=1)  # the same streams each wave (the prompts then hit the
    expected = engine_tokens(long_reference, requests)  # prefill's prefix cache: fine)
    for wave in range(KILLS):
        _wave(cluster, metrics_port, requests, expected, signal.SIGKILL, f"kill {wave}")
    assert sum(supervisor.restarts.values()) == KILLS
    assert set(supervisor.restarts) <= {"decode0", "decode1"}
    assert sum("exited with code -9" in line for line in said) == KILLS
    assert sum(" is back " in line for line in said) == KILLS


def test_streams_leave_a_frozen_decode(supervised, long_reference):
    """SIGSTOP: the socket stays open and silent. The decode stops heartbeating; the router
    counts it lost after the heartbeat timeout and moves its streams (StreamLost)."""
    cluster, supervisor, metrics_port, _said = supervised
    requests = _requests(seed=2)[:12]
    expected = engine_tokens(long_reference, requests)
    restarts0 = sum(supervisor.restarts.values())
    lost0 = _migrations(metrics_port, reason="lost")
    _wave(cluster, metrics_port, requests, expected, signal.SIGSTOP, "freeze")
    assert sum(supervisor.restarts.values()) == restarts0 + 1
    # the watchdog, not a socket error
    assert _migrations(metrics_port, reason="lost") > lost0, _migration_reasons(metrics_port)


def test_colocated_streams_survive_a_killed_worker(long_model_dir, long_reference):
    """The same for the colocated topology: a Generate stream moves to the other worker."""
    metrics_port = _free_port()
    cluster = start_cluster(
        long_model_dir,
        mode="colocated",
        colocated=2,
        worker_args=WORKER_ARGS,
        router_args=[f"--metrics-port={metrics_port}"],
    )
    try:
        requests = _requests(seed=3)[:12]
        expected = engine_tokens(long_reference, requests)
        hit: list[str] = []

        def hit_when_running() -> bool:
            infos = {n: worker_info(cluster, n) for n in ("colocated0", "colocated1")}
            victim = max(infos, key=lambda n: infos[n].load.num_running)
            if infos[victim].load.num_running < MIN_RUNNING_AT_KILL:
                return False
            cluster.processes[victim].signal(signal.SIGKILL)
            hit.append(victim)
            return True

        results = asyncio.run(_run_wave(cluster.addr, requests, hit_when_running))
        failures = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
        assert not failures, f"client-visible failures: {failures[:3]}"
        assert [r[0] for r in results] == expected
        assert _migrations(metrics_port) > 0
        (survivor,) = [n for n in ("colocated0", "colocated1") if n != hit[0]]
        wait_until(lambda: pool_idle(cluster, survivor), 30, f"{survivor} idle")
    finally:
        cluster.stop()
