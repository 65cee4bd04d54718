"""The cluster across hosts: one network namespace per host (scripts/netns-cluster.sh), joined
by veth pairs and a bridge in a namespace of its own, each host with its own address:

    router0 10.77.0.1 | router1 .2 | kvstore .10 | prefill0 .20 | decode0 .40 | decode1 .41
    client .100

Every service listens on its host's address only (in its host's own network, IPC and PID
namespaces, as in a container), certificates name those addresses, and KV crosses hosts
over UCX TCP. Every worker registers with both routers; the routers share a resume secret
(no Redis: no API keys here, flips off). The test itself stays in the machine's namespace
(no route to the hosts) and drives a client agent on the `client` host (netns_agent.py,
netns_layout.py), whose SDK client is given both routers. Under load it checks:

1. tokens equal the in-process engine's, the streams spread over both routers; each router
   knows every worker and both routers; the KV bytes the prefill sent over UCX left its host
   through its interface (not shared memory), and the decodes' and the kvstore's came in
   through theirs; each service's certificate names its host's address;
2. a decode host cut off from the network mid-stream: its streams move on, each router drops
   it within its lease, and once reconnected it rejoins once on each (same instance, one
   registration), with nothing held;
3. a decode host going down (every process on it killed) mid-stream: its streams move to the
   host that rejoined (whose tokens must be exact: no stale KV), and each router drops it
   within its lease;
4. a router host going down (every process on it killed) mid-stream: the SDK resumes each of
   its streams on the other router (tokens exact, each once, no gap), the survivor keeps
   every worker registered (no re-registration), and the decodes drop the dead router's
   streams at once (their blocks freed while the resumed streams run); new SDK streams
   (from a client given both addresses) and an HTTP request are served by the survivor at
   once.

Runs as root where `ip netns` works (CI); elsewhere it skips with the reason. Every wait is
bounded (hang guards); the lease bound is the registry's contract, with slack for a busy host.
"""

from __future__ import annotations

import inspect
import secrets
import sys
import time
from pathlib import Path

import pytest

from pdserve.client.aio import AsyncClient
from pdserve.router.settings import LifecycleSettings
from pdserve.workload.requests import greedy_and_seeded_streams

from .conftest import VOCAB, engine_tokens
from .netns_layout import Agent, Layout, script, unavailable

pytestmark = pytest.mark.integration

CONTEXT = 512
ROUTERS = 2  # router0 and router1, each on a host of its own
N_STREAMS = 16
LONG_TOKENS = 400  # streams last long enough for a fault to land mid-stream
HEARTBEAT_S = 0.5
LEASE_S = 2.5  # the router's heartbeat timeout: a silent instance is dropped after it
LEASE_SLACK_S = 2.5  # the registry's sweep period, the status poll and a busy machine
ROUTER_ARGS = (
    f"--heartbeat-interval-s {HEARTBEAT_S} --heartbeat-timeout-s {LEASE_S} "
    "--max-instances-per-identity 1"  # every worker has its own certificate
)
WORKER_ARGS = "--num-blocks 1024 --max-num-batched-tokens 512"
# the router's documented longest gap between two messages of a stream (its default)
DECODE_IDLE_DEADLINE_S = LifecycleSettings.model_fields["decode_idle_deadline_s"].default
# how long the SDK keeps resuming a stream whose router died (its default)
RESUME_TIMEOUT_S = inspect.signature(AsyncClient).parameters["resume_timeout_s"].default
MIN_RUNNING_AT_FAULT = 2  # hit a host once it runs at least this many streams
MARGIN_TOKENS = 64  # a decode runs at most this far ahead of what its client received
N_NEW, NEW_TOKENS = 8, 16  # new requests sent once a router host is down
# hang guard for their first token: a call stuck on the dead router would wait for gRPC's
# 20 s connect timeout, one moved at once waits for a prefill beside the resumed streams
NEW_FIRST_GUARD_S = 15.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pdserve.model.tiny import TinySpec, make_tiny

    root = tmp_path_factory.mktemp("multihost-tiny")
    return Path(make_tiny(root / "llama", TinySpec(vocab=VOCAB, max_pos=CONTEXT)))


@pytest.fixture(scope="module")
def reference(model_dir):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

    return LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32", num_blocks=2048))


@pytest.fixture(scope="module")
def layout(request, tmp_path_factory):
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    model_dir = request.getfixturevalue("model_dir")  # (after the check: a skip costs nothing)
    name = "pdt" + secrets.token_hex(4)  # unique per run: two runs never share a namespace
    state = tmp_path_factory.mktemp("netns") / name
    agent = None
    try:
        r = script(
            "up", "--name", name, "--dir", str(state), "--model", str(model_dir),
            "--python", sys.executable, "--routers", str(ROUTERS), "--prefill", "1",
            "--decode", "2",
            "--router-args", ROUTER_ARGS, "--worker-args", WORKER_ARGS,
            "--kvstore-bytes", str(64 << 20), "--timeout", "150",
            timeout=200,
        )  # fmt: skip
        assert r.returncode == 0, f"netns-cluster.sh up failed:\n{r.stdout}\n{r.stderr}"
        agent = Agent(f"{name}-client", state / "certs", state / "logs" / "agent.log")
        layout = Layout(name, state, agent)
        yield layout
        print(layout.logs())  # shown when a test of the module failed
    finally:
        if agent is not None:
            agent.close()
        script("--name", name, "--dir", str(state), "down", timeout=60)


# ----------------------------------------------------------------------------- helpers


def _requests(seed: int, max_tokens: int) -> list[dict]:
    return greedy_and_seeded_streams(N_STREAMS, max_tokens, VOCAB, seed)


def _kv_bytes_in(layout: Layout) -> int:
    """Bytes the kvstore took in over UCX (puts)."""
    stats = layout.agent.call("kvstats", addr=f"{layout.addr('kvstore')}:50060")
    return int(stats.get("bytes_in", 0))  # (proto3 JSON: absent when 0, a string)


def _wait(pred, timeout: float, what: str, interval: float = 0.1) -> float:
    """Poll until `pred()`; return the seconds it took. Fails after `timeout` (hang guard)."""
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what}: not within {timeout:g} s")
        time.sleep(interval)
    return time.monotonic() - start


def _check_results(results: list[dict], expected: list[list[int]], label: str) -> float:
    """Every stream complete, exact and never silent past the router's documented deadline
    between two messages; returns the longest silence."""
    errors = [(i, r["error"]) for i, r in enumerate(results) if r["error"]]
    assert not errors, f"{label}: client-visible failures {errors[:3]}"
    gap = max(r["max_gap_s"] for r in results)
    assert gap < DECODE_IDLE_DEADLINE_S, f"{label}: a stream was silent for {gap:.1f} s"
    wrong = [
        i for i, (r, e) in enumerate(zip(results, expected, strict=True)) if r["token_ids"] != e
    ]
    assert not wrong, f"{label}: tokens differ from the in-process engine's in streams {wrong}"
    assert all(r["finish_reason"] == "length" for r in results)
    return gap


def _dropped(layout: Layout, host: str, what: str) -> float:
    """Seconds until no router lists `host`'s instance (polled from the fault on); each
    router's registry must drop it within its lease."""
    start, gone = time.monotonic(), {}

    def every_router_dropped() -> bool:
        for r in layout.routers:
            if r not in gone and not layout.instance_at(host, r):
                gone[r] = time.monotonic() - start
        return len(gone) == len(layout.routers)

    _wait(every_router_dropped, LEASE_S + 10, f"{what}: {host} dropped by every router")
    worst = max(gone.values())
    assert worst <= LEASE_S + LEASE_SLACK_S, (
        f"{host} {what}: dropped from the registries after {gone} s, lease {LEASE_S} s"
    )
    return worst


def _start_and_hit(layout: Layout, batch: str, requests: list[dict], decodes: list[str]) -> str:
    """Start the streams; once every one has a token and one of `decodes` runs several of
    them, return that host (the caller hits it at once)."""
    layout.agent.call("start", batch=batch, router=layout.router, requests=requests, stream_s=120)
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"{batch}: the streams never ran on {decodes}"
        p = layout.agent.call("progress", batch=batch)
        assert p["done"] < len(requests), f"{batch}: every stream ended before the fault"
        if min(p["tokens"]) >= 1:
            running = {h: layout.info(h)["load"].get("num_running", 0) for h in decodes}
            busiest = max(running, key=running.get)
            if running[busiest] >= MIN_RUNNING_AT_FAULT:
                return busiest
        time.sleep(0.02)


# ----------------------------------------------------------------------------- the tests


def test_tokens_and_kv_cross_hosts(layout: Layout, reference):
    hosts = ("prefill0", "decode0", "decode1", "kvstore")
    workers = {layout.worker(h) for h in ("prefill0", "decode0", "decode1")}
    routers = sorted(layout.public(r) for r in layout.routers)
    assert len(routers) == ROUTERS
    for r in layout.routers:  # each router knows every worker, and (by their reports) both
        assert {i["address"] for i in layout.instances(r)} == workers, r

        def knows_both(r=r) -> bool:
            known = layout.status(r)["routers"]
            return sorted(k["address"] for k in known) == routers and all(
                k["workers"] == len(workers) for k in known
            )

        _wait(knows_both, 15, f"{r} lists both routers, each reported by every worker")
    total0 = {r: layout.status(r)["requests_total"] for r in layout.routers}
    sent0 = layout.info("prefill0")["counters"]["ucx_bytes_sent"]
    recv0 = {h: layout.info(h)["counters"]["ucx_bytes_received"] for h in ("decode0", "decode1")}
    kv_in0 = _kv_bytes_in(layout)
    link0 = {h: layout.link_bytes(h) for h in hosts}

    requests = _requests(seed=1, max_tokens=24)
    layout.agent.call("start", batch="plain", router=layout.router, requests=requests, stream_s=120)
    results = layout.agent.call("wait", batch="plain", wait_s=120, timeout=130)
    _check_results(results, engine_tokens(reference, requests), "plain")
    served = {r: layout.status(r)["requests_total"] - total0[r] for r in layout.routers}
    assert sum(served.values()) == len(requests) and min(served.values()) > 0, served

    # KV left the prefill's host through its interface and reached each decode through
    # theirs: over TCP between hosts, not shared memory (UCX counts every message).
    sent = layout.info("prefill0")["counters"]["ucx_bytes_sent"] - sent0
    assert sent > 0
    link = {h: layout.link_bytes(h) for h in hosts}
    assert link["prefill0"][1] - link0["prefill0"][1] >= sent
    for h in ("decode0", "decode1"):
        got = layout.info(h)["counters"]["ucx_bytes_received"] - recv0[h]
        assert got > 0, f"{h} received no KV (placement used one decode only?)"
        assert link[h][0] - link0[h][0] >= got
    kv_in = _kv_bytes_in(layout) - kv_in0
    assert kv_in > 0, "nothing was published to the kvstore"
    assert link["kvstore"][0] - link0["kvstore"][0] >= kv_in

    # Each certificate names its host's address: a client verifying the server against the
    # address it dials (not the cluster name) gets through, and one expecting another
    # host's address is refused.
    for addr in (
        *(f"{layout.addr(r)}:50061" for r in layout.routers),
        f"{layout.addr('kvstore')}:50060",
        *(layout.worker(h) for h in ("prefill0", "decode0", "decode1")),
    ):
        check = layout.agent.call("tls_check", addr=addr)
        assert check["ok"], f"{addr}: {check['error']}"
    wrong = layout.agent.call(
        "tls_check", addr=layout.worker("decode0"), server_name=layout.addr("prefill0")
    )
    assert not wrong["ok"], "decode0's certificate passed for prefill0's address"


def test_a_host_cut_off_and_reconnected(layout: Layout, reference):
    """A decode host's link goes down mid-stream (its processes live on, silent): its streams
    move to the other decode, each router drops it within its lease; reconnected, it rejoins
    each router once (the same instance, one registration) and holds nothing of the streams
    it lost."""
    requests = _requests(seed=2, max_tokens=LONG_TOKENS)
    expected = engine_tokens(reference, requests)
    lost0 = layout.migrations("lost")
    victim = _start_and_hit(layout, "cut", requests, ["decode0", "decode1"])
    (victim_id,) = {i["id"] for r in layout.routers for i in layout.instance_at(victim, r)}
    registered0 = {r: layout.registrations(victim_id, r) for r in layout.routers}
    layout.script("cut", victim)
    try:
        dropped_s = _dropped(layout, victim, "cut off")
        _wait(lambda: layout.migrations("lost") > lost0, 30, "streams moved off the cut host")
    finally:
        layout.script("heal", victim)
    # Rejoins once: the same instance (the worker re-registers its own id), one registration.
    rejoin_s = _wait(
        lambda: all(len(layout.instance_at(victim, r)) == 1 for r in layout.routers),
        30,
        f"{victim} rejoined every router",
    )
    print(
        f"cut: {victim} dropped after {dropped_s:.2f} s (lease {LEASE_S} s), "
        f"rejoined {rejoin_s:.2f} s after the link came back"
    )
    results = layout.agent.call("wait", batch="cut", wait_s=120, timeout=130)
    gap = _check_results(results, expected, "cut")
    print(f"cut: the longest silence of a stream {gap:.2f} s")
    assert layout.info(victim)["instance_id"] == victim_id
    _wait(lambda: layout.idle(victim), 30, f"{victim} released the streams it lost")
    for r in layout.routers:
        assert layout.registrations(victim_id, r) == registered0[r] + 1, r
        ids = [i["id"] for i in layout.instances(r)]
        assert len(ids) == len(set(ids)) == 3, (r, ids)
    for host in ("prefill0", "decode0", "decode1"):
        _wait(lambda host=host: layout.idle(host), 30, f"{host} idle")


def test_a_host_goes_down(layout: Layout, reference):
    """Every process on a decode host killed mid-stream: its streams move to the other
    decode (the one that rejoined above: its tokens must be exact, no stale KV), and each
    router drops the dead host within its lease."""
    for r in layout.routers:
        assert len(layout.instances(r)) == 3, f"the previous test left {r} short"
    requests = _requests(seed=3, max_tokens=LONG_TOKENS)
    expected = engine_tokens(reference, requests)
    moved0 = layout.migrations("unavailable") + layout.migrations("lost")
    victim = _start_and_hit(layout, "down", requests, ["decode0", "decode1"])
    (survivor,) = {"decode0", "decode1"} - {victim}
    layout.script("kill", victim)
    dropped_s = _dropped(layout, victim, "down")
    results = layout.agent.call("wait", batch="down", wait_s=120, timeout=130)
    gap = _check_results(results, expected, "down")
    assert layout.migrations("unavailable") + layout.migrations("lost") > moved0
    print(
        f"host down: {victim} dropped after {dropped_s:.2f} s (lease {LEASE_S} s); "
        f"the longest silence of a stream {gap:.2f} s"
    )
    for host in ("prefill0", survivor):
        _wait(lambda host=host: layout.idle(host), 30, f"{host} idle")


def test_a_router_host_goes_down(layout: Layout, reference):
    """Every process on a router host killed mid-stream: the SDK resumes each stream it
    carried on the other router (tokens exact: each once, in order, no gap); the survivor
    keeps every worker registered, without a new registration; each decode drops the dead
    router's streams as their calls break (its running sequences never exceed the
    survivor's streams while the resumed ones run); new requests reach the survivor at once
    (SDK and HTTP), and every pool is idle afterwards."""
    workers = {i["address"]: i["id"] for i in layout.instances(layout.routers[0])}
    for r in layout.routers[1:]:
        assert {i["address"]: i["id"] for i in layout.instances(r)} == workers, r
    worker_hosts = [h for h in layout.hosts if layout.worker(h) in workers]
    decodes = [h for h in worker_hosts if h.startswith("decode")]
    requests = _requests(seed=4, max_tokens=LONG_TOKENS)
    expected = engine_tokens(reference, requests)
    new = _requests(seed=5, max_tokens=NEW_TOKENS)[:N_NEW]
    new_expected = engine_tokens(reference, new)
    resumed0 = {r: layout.counter(r, "resumes", 'outcome="resumed"') for r in layout.routers}
    layout.agent.call(
        "start", batch="router", router=layout.router, requests=requests, stream_s=120
    )
    deadline = time.monotonic() + 60
    while True:  # every stream has a token (so each must resume), the victim carries several
        assert time.monotonic() < deadline, "router: the streams never got going"
        p = layout.agent.call("progress", batch="router")
        assert p["done"] == 0, "router: a stream ended before the fault"
        if min(p["tokens"]) >= 1:
            running = {r: layout.status(r)["requests_running"] for r in layout.routers}
            victim = max(running, key=running.get)
            if running[victim] >= MIN_RUNNING_AT_FAULT:
                break
        time.sleep(0.02)
    (survivor,) = set(layout.routers) - {victim}
    registered0 = {i: layout.registrations(i, survivor) for i in workers.values()}
    layout.script("kill", victim)
    killed_at = time.monotonic()
    # New requests at once, from a new SDK client given both addresses (it does not know
    # which one died: a call that meets the dead one is retried on the other at once).
    layout.agent.call(
        "start", batch="new", router=layout.router, requests=new, stream_s=120, retries=3
    )

    # Long before any stream could end, the decodes hold none of the dead router's streams:
    # every sequence they run belongs to a request the survivor runs (read it first). (Left
    # running, the dead router's sequences would hold their blocks to the end.)
    def dead_routers_streams_dropped() -> bool:
        most = max(layout.agent.call("progress", batch="router")["tokens"])
        assert most <= LONG_TOKENS - MARGIN_TOKENS, (
            "router: the streams neared their end before the decodes dropped the dead router's"
        )
        on_survivor = layout.status(survivor)["requests_running"]
        on_decodes = sum(layout.info(h)["load"].get("num_running", 0) for h in decodes)
        return on_decodes <= on_survivor

    freed_s = _wait(dead_routers_streams_dropped, 30, "the decodes dropped the dead router's")
    # The survivor's HTTP door serves a new request too (HTTP has no resume: the dead
    # router's HTTP streams are lost, docs/FAULTS.md; none run here).
    http = layout.agent.call(
        "http_completion", url=f"http://{layout.addr(survivor)}:8000",
        prompt=new[0]["token_ids"], max_tokens=NEW_TOKENS, timeout=60,
    )  # fmt: skip
    assert http["status"] == 200, f"HTTP on {survivor}: {http}"
    assert http["body"]["choices"][0]["token_ids"] == new_expected[0], http["body"]
    new_results = layout.agent.call("wait", batch="new", wait_s=120, timeout=130)
    _check_results(new_results, new_expected, "new after the router host went down")
    first = max(r["first_s"] for r in new_results)
    assert first < NEW_FIRST_GUARD_S, (
        f"a new request waited {first:.1f} s for its first token (on the dead router?)"
    )
    results = layout.agent.call("wait", batch="router", wait_s=120, timeout=130)
    gap = _check_results(results, expected, "router down")
    assert gap < RESUME_TIMEOUT_S, f"a resumed stream was silent for {gap:.1f} s"
    resumed = layout.counter(survivor, "resumes", 'outcome="resumed"') - resumed0[survivor]
    assert resumed == running[victim], (
        f"{running[victim]} streams on {victim}, {resumed} resumed on {survivor}"
    )
    # The survivor keeps every worker through (and past) a lease, never re-registering one;
    # its Status soon lists itself alone (the workers report the dead router gone).
    time.sleep(max(0.0, killed_at + LEASE_S + LEASE_SLACK_S - time.monotonic()))
    assert {i["address"]: i["id"] for i in layout.instances(survivor)} == workers
    assert {i: layout.registrations(i, survivor) for i in workers.values()} == registered0

    def alone() -> bool:
        return [k["address"] for k in layout.status(survivor)["routers"]] == [
            layout.public(survivor)
        ]

    _wait(alone, 15, f"{survivor} lists itself alone")
    print(
        f"router host down: {victim} killed with {running[victim]} of {N_STREAMS} streams, "
        f"all resumed on {survivor}; the decodes dropped them within {freed_s:.2f} s; "
        f"the longest silence of a stream {gap:.2f} s; {N_NEW} new SDK streams and an HTTP "
        f"request served by {survivor}, first tokens within {first:.2f} s"
    )
    for host in worker_hosts:
        _wait(lambda host=host: layout.idle(host), 30, f"{host} idle")
