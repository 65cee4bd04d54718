"""API keys (auth.py) and the admission stage's per-key limits and bounded queue
(scheduling/admission.py): logic only, no servers."""

from __future__ import annotations

import asyncio
import contextlib
import json

import grpc
import pytest
from prometheus_client import CollectorRegistry

from pdserve.errors import OverloadedError, UnauthenticatedError
from pdserve.router.frontdoor.auth import ANONYMOUS, ApiKey, ApiKeys, key_id, metadata_value
from pdserve.router.scheduling import admission as admission_mod
from pdserve.router.scheduling.admission import Admission, AdmissionConfig
from pdserve.rpc.interceptor import retry_metadata
from pdserve.rpc.metrics import Metrics


def test_open_without_keys():
    keys = ApiKeys.load()
    assert keys.open and keys.authenticate(None) is ANONYMOUS
    assert keys.authenticate("Bearer anything") is ANONYMOUS


def test_keys_from_flags_and_file(tmp_path):
    f = tmp_path / "keys.json"
    f.write_text(
        json.dumps(
            {"keys": [{"name": "team-a", "key": "sk-a", "max_concurrent": 2}, {"key": "sk-b"}]}
        )
    )
    keys = ApiKeys.load(["sk-cli"], f, max_concurrent=5, tokens_per_minute=100)
    assert not keys.open and len(keys) == 3
    a = keys.authenticate("Bearer sk-a")
    assert (a.name, a.max_concurrent, a.tokens_per_minute) == ("team-a", 2, 100)
    assert keys.authenticate("bearer  sk-cli ").name == key_id("sk-cli")
    assert keys.authenticate("Bearer sk-b").name == key_id("sk-b")
    assert "sk-" not in key_id("sk-cli").removeprefix("key-")  # the label hides the secret


@pytest.mark.parametrize(
    "header, words",
    [
        (None, "missing"),
        ("", "missing"),
        ("Basic sk-a", "Bearer"),
        ("Bearer", "Bearer"),
        ("Bearer nope", "invalid"),
    ],
)
def test_bad_credentials(header, words):
    keys = ApiKeys.load(["sk-a"])
    with pytest.raises(UnauthenticatedError) as info:
        keys.authenticate(header)
    assert words in str(info.value) and info.value.code == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(
    "content, words",
    [
        ("not json", "keys.json"),
        ('{"keys": {}}', "expected"),
        ('{"keys": [{"name": "x"}]}', "empty"),
        ('{"keys": [{"name": "x", "key": "a"}, {"name": "x", "key": "b"}]}', "twice"),
        ('{"keys": [{"name": "x", "key": "a", "max_concurrent": -1}]}', ">= 0"),
    ],
)
def test_bad_keys_file(tmp_path, content, words):
    f = tmp_path / "keys.json"
    f.write_text(content)
    with pytest.raises(ValueError) as info:
        ApiKeys.load([], f)
    assert words in str(info.value)


def test_metadata_value():
    md = (("x-request-id", "r"), ("authorization", b"Bearer k"))
    assert metadata_value(md) == "Bearer k" and metadata_value(None) is None


def _value(q: Admission, name: str, **labels) -> float:
    return q.registry.get_sample_value("pdserve_" + name, labels) or 0.0


def _quotas(**kw) -> Admission:
    registry = CollectorRegistry()
    q = Admission(Metrics(registry), AdmissionConfig(**kw))
    q.registry = registry  # type: ignore[attr-defined]
    return q


@contextlib.asynccontextmanager
async def _run(q: Admission, key: ApiKey, predicted: float = 0.0):
    """A request through the whole stage: per-key admission, then its queue turn."""
    async with q.admit(key) as p:
        await p.turn(predicted)
        yield p


async def test_per_key_concurrency():
    q = _quotas()
    key = ApiKey("k", max_concurrent=2)
    async with q.admit(key), q.admit(key):
        with pytest.raises(OverloadedError) as info:
            async with q.admit(key):
                pass
        assert "max_concurrent=2" in str(info.value) and info.value.retry_after_s >= 1
        async with q.admit(ApiKey("other", max_concurrent=1)):  # other keys are not affected
            pass
    async with q.admit(key):  # released
        pass
    assert q.state(key).running == 0
    assert _value(q, "router_key_requests_total", key="k") == 3
    assert _value(q, "router_key_rejections_total", key="k", reason="concurrency") == 1
    assert _value(q, "router_key_streams", key="k") == 0


async def test_tokens_per_minute(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(admission_mod.time, "monotonic", lambda: now[0])
    q = _quotas()
    key = ApiKey("k", tokens_per_minute=100)
    async with q.admit(key) as a:
        a.charge(60)
    now[0] += 30
    async with q.admit(key) as a:
        a.charge(50)  # 110 in the window: the next request is refused
    with pytest.raises(OverloadedError) as info:
        async with q.admit(key):
            pass
    assert info.value.retry_after_s == pytest.approx(30.0)  # when the first 60 expire
    now[0] += 31
    async with q.admit(key):
        pass
    assert _value(q, "router_key_tokens_total", key="k") == 110
    assert _value(q, "router_key_rejections_total", key="k", reason="tokens_per_minute") == 1


async def test_bounded_queue():
    q = _quotas(max_running=1, max_queue=1, timeout_s=5)
    key = ApiKey("k")
    gate = asyncio.Event()
    entered = []

    async def hold(i):
        async with _run(q, key):
            entered.append(i)
            await gate.wait()

    first = asyncio.create_task(hold(1))
    await asyncio.sleep(0)
    second = asyncio.create_task(hold(2))  # waits in the queue
    await asyncio.sleep(0)
    assert entered == [1] and q.waiting == 1
    with pytest.raises(OverloadedError) as info:  # queue full
        async with _run(q, key):
            pass
    assert "max_queue=1" in str(info.value)
    gate.set()
    await asyncio.gather(first, second)
    assert entered == [1, 2] and q.waiting == 0
    assert _value(q, "router_key_rejections_total", key="k", reason="queue_full") == 1
    assert _value(q, "router_queue_waiting") == 0


async def test_queue_timeout():
    q = _quotas(max_running=1, max_queue=4, timeout_s=0.05)
    key = ApiKey("k")
    async with _run(q, key):
        with pytest.raises(OverloadedError) as info:
            async with _run(q, key):
                pass
    assert "no turn within" in str(info.value)
    assert q.state(key).running == 0 and q.waiting == 0


def test_retry_after_metadata():
    assert retry_metadata(OverloadedError("x", retry_after_s=2.2)) == (("retry-after", "3"),)
    assert retry_metadata(OverloadedError("x")) == ()
    assert retry_metadata(ValueError()) == ()
