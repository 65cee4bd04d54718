"""The OpenAI-compatible HTTP API, the API keys and the per-key limits, driven by the official
`openai` package and the gRPC SDK against one real cluster (router with --http-port and a
keys file, 1 prefill + 1 decode): the same greedy request gives the same tokens on both doors,
a missing or wrong key gets 401 / UNAUTHENTICATED, a key over its concurrency gets 429 with
Retry-After, and cached_tokens grows over a chat's turns. Also reflection and Status."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest

from pdserve.client import Client, ResourceExhausted, Unauthenticated

from .conftest import BLOCK_SIZE, MAX_POS, VOCAB, start_cluster

pytestmark = pytest.mark.integration

KEYS = {"alpha": "sk-alpha-secret", "beta": "sk-beta-secret"}
MAX_BODY = 64 << 10  # --max-request-bytes of this module's router
SYSTEM = (
    "You are the harbor master of a small fishing town. You answer questions about boats, "
    "tides, the weather and the fish market, briefly and politely."
)


@pytest.fixture(scope="module")
def cluster(serving_model_dir, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("keys") / "keys.json"
    keys_file.write_text(
        json.dumps(
            {
                "keys": [
                    {"name": "alpha", "key": KEYS["alpha"], "max_concurrent": 1},
                    {"name": "beta", "key": KEYS["beta"]},
                ]
            }
        )
    )
    c = start_cluster(
        serving_model_dir,
        prefill=1,
        decode=1,
        http_port=0,
        router_args=["--api-keys-file", str(keys_file), "--max-request-bytes", str(MAX_BODY)],
        api_key=KEYS["beta"],
    )
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def oai(cluster):
    with openai.OpenAI(base_url=cluster.http_url, api_key=KEYS["beta"], max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def grpc_client(cluster):
    with Client(cluster.addr, api_key=KEYS["beta"], max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def model_name(oai):
    return oai.models.list().data[0].id


GREEDY = dict(temperature=0.0, max_tokens=12)
EXTRA = {"ignore_eos": True, "return_token_ids": True}


def _ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])


def test_completions_same_tokens_as_grpc(oai, grpc_client, model_name):
    prompt = [5, 17, 42, 99, 123, 7, 300, 11]
    ref = grpc_client.generate(token_ids=prompt, ignore_eos=True, **GREEDY)
    assert len(ref.token_ids) == 12
    whole = oai.completions.create(model=model_name, prompt=prompt, extra_body=EXTRA, **GREEDY)
    assert _ids(whole.choices[0]) == list(ref.token_ids)
    assert whole.choices[0].text == ref.text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(prompt) and whole.usage.completion_tokens == 12
    ids, text = [], ""
    stream = oai.completions.create(
        model=model_name, prompt=prompt, stream=True, extra_body=EXTRA, **GREEDY
    )
    for chunk in stream:
        if chunk.choices:
            ids += _ids(chunk.choices[0])
            text += chunk.choices[0].text
    assert ids == list(ref.token_ids) and text == ref.text


def test_chat_same_tokens_as_grpc(oai, grpc_client, model_name):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello!"}]
    ref = grpc_client.generate(messages=messages, ignore_eos=True, **GREEDY)
    whole = oai.chat.completions.create(
        model=model_name, messages=messages, extra_body=EXTRA, **GREEDY
    )
    assert _ids(whole.choices[0]) == list(ref.token_ids)
    assert whole.choices[0].message.content == ref.text
    assert whole.choices[0].message.role == "assistant"
    ids, text, usage = [], "", None
    stream = oai.chat.completions.create(
        model=model_name,
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=EXTRA,
        max_completion_tokens=12,
        temperature=0.0,
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            ids += _ids(choice)
            text += choice.delta.content or ""
    assert ids == list(ref.token_ids) and text == ref.text
    assert usage is not None and usage.completion_tokens == 12
    assert usage.prompt_tokens == ref.prompt_tokens


def test_missing_or_wrong_key_is_401(cluster, model_name):
    for key in ("", "sk-wrong"):
        with openai.OpenAI(base_url=cluster.http_url, api_key=key or "x", max_retries=0) as c:
            if not key:  # no header at all
                r = httpx.post(
                    cluster.http_url + "/completions", json={"prompt": "hi", "max_tokens": 2}
                )
                assert r.status_code == 401 and "Bearer" in r.json()["error"]["message"]
                continue
            with pytest.raises(openai.AuthenticationError):
                c.completions.create(model=model_name, prompt="hi", max_tokens=2)
    with Client(cluster.addr, api_key="", max_retries=0) as c, pytest.raises(Unauthenticated):
        c.generate(prompt="hi", max_tokens=2)
    with Client(cluster.addr, api_key="sk-wrong", max_retries=0) as c:
        with pytest.raises(Unauthenticated):
            c.status()


def test_concurrency_limit_is_429_with_retry_after(cluster, model_name):
    """alpha may run one stream: a second one, on either door, is refused while the first
    runs, and admitted again once it finished."""
    with openai.OpenAI(base_url=cluster.http_url, api_key=KEYS["alpha"], max_retries=0) as c:
        long = c.completions.create(
            model=model_name,
            prompt="Once upon a time",
            max_tokens=MAX_POS // 2,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(long))  # admitted and streaming
        with pytest.raises(openai.RateLimitError) as info:
            c.completions.create(model=model_name, prompt="hi", max_tokens=2)
        assert int(info.value.response.headers["retry-after"]) >= 1
        assert "max_concurrent=1" in info.value.message
        with Client(cluster.addr, api_key=KEYS["alpha"], max_retries=0) as g:
            with pytest.raises(ResourceExhausted) as ginfo:
                g.generate(prompt="hi", max_tokens=2)
            assert ginfo.value.retry_after_s is not None and ginfo.value.retry_after_s >= 1
        long.close()
        for _ in range(50):  # the router releases the slot when it sees the disconnect
            try:
                ok = c.completions.create(model=model_name, prompt="hi", max_tokens=2)
                break
            except openai.RateLimitError:
                time.sleep(0.1)
        else:
            pytest.fail("the key's slot was not released after the stream closed")
        assert ok.choices[0].finish_reason in ("length", "stop")
    log = cluster.processes["router"].log_path.read_text()
    assert "request cancelled by the client" in log  # the closed stream left a line


def test_cached_tokens_grow_over_a_chat(oai, model_name):
    messages = [{"role": "system", "content": SYSTEM}]
    cached = []
    for turn in ("Good morning!", "Are the boats out today?", "And the tide?"):
        messages.append({"role": "user", "content": turn})
        r = oai.chat.completions.create(
            model=model_name,
            messages=messages,
            max_tokens=8,
            temperature=0.0,
            extra_body={"session_id": "harbor-chat"},
        )
        cached.append(r.usage.prompt_tokens_details.cached_tokens)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
    assert cached[0] < cached[1] < cached[2], cached
    assert cached[1] >= BLOCK_SIZE


def test_http_errors_name_the_parameter(cluster, model_name):
    url, auth = cluster.http_url, {"authorization": f"Bearer {KEYS['beta']}"}
    cases = [
        ("/completions", {"prompt": [1, VOCAB + 5]}, 400, "prompt"),
        ("/completions", {"prompt": "hi", "top_p": 3}, 400, "top_p"),
        ("/completions", {"prompt": "hi", "n": 2}, 400, "n"),
        ("/completions", {"prompt": "hi", "logprobs": 2}, 400, "logprobs"),
        ("/completions", {"prompt": "hi", "max_tokens": "x"}, 400, "max_tokens"),
        ("/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages"),
        (
            "/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "model": "gpt"},
            404,
            None,
        ),
    ]
    for path, body, status, param in cases:
        r = httpx.post(url + path, json=body, headers=auth)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert err["param"] == param and (param is None or err["message"].startswith(param))
    health = httpx.get(url.removesuffix("/v1") + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_status_and_reflection(cluster, grpc_client, serving_model_dir):
    status = grpc_client.status()
    assert status.model == serving_model_dir.name  # a name, not the path
    assert (status.vocab_size, status.context_length) == (VOCAB, MAX_POS)
    assert status.block_size == BLOCK_SIZE and status.dtype == "float32"

    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    with grpc.insecure_channel(cluster.addr) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {"pdserve.v1.Router", "grpc.health.v1.Health"} <= services
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(db)
        router = pool.FindServiceByName("pdserve.v1.Router")
        assert {m.name for m in router.methods} == {"Generate", "Status", "Resume"}
        status_msg = pool.FindMessageTypeByName("pdserve.v1.StatusResponse")
        assert "context_length" in status_msg.fields_by_name


def test_grpc_cancel_leaves_a_log_line(cluster, grpc_client):
    from .conftest import wait_until

    log_path = cluster.processes["router"].log_path
    line = "request cancelled by the client"
    before = log_path.read_text().count(line)
    stream = grpc_client.generate_stream(prompt="Once", max_tokens=100, ignore_eos=True)
    next(stream)
    stream.close()  # cancels the call
    wait_until(lambda: log_path.read_text().count(line) > before, 15, "the cancel log line")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_before_its_answer_cancels_the_request(cluster, model_name, stream):
    """The prefill is frozen (SIGSTOP), so no token can come; the client gives up (read
    timeout) and disconnects. The router must notice and cancel the request -- a
    non-streaming one as well as a stream still waiting for its first token -- instead of
    finishing work nobody reads. Then the prefill resumes and no worker holds a KV block."""
    import signal

    from .conftest import pool_idle, wait_until

    log_path = cluster.processes["router"].log_path
    line = "request cancelled by the client"
    before = log_path.read_text().count(line)
    prefill = cluster.processes["prefill0"]
    prefill.signal(signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{cluster.http_url}/completions",
                headers={"Authorization": f"Bearer {KEYS['beta']}"},
                json={"model": model_name, "prompt": "a tide table", "max_tokens": 8,
                      "stream": stream},
                timeout=httpx.Timeout(10.0, read=0.5),
            )  # fmt: skip
        # within the freeze (well under the 3 s heartbeat timeout): the disconnect itself
        # cancelled it, not a worker failure
        wait_until(lambda: log_path.read_text().count(line) > before, 2, "the cancel log line")
    finally:
        prefill.signal(signal.SIGCONT)
    for name in ("prefill0", "decode0"):
        wait_until(lambda name=name: pool_idle(cluster, name), 30, f"{name} idle")


def test_a_body_over_max_request_bytes_is_413_before_it_is_read(cluster, model_name):
    """--max-request-bytes bounds HTTP bodies as it bounds gRPC messages: a declared
    Content-Length over it is refused at once, a chunked body (no Content-Length) as soon as
    the count passes it; the router keeps serving."""
    url = cluster.http_url + "/completions"
    auth = {"authorization": f"Bearer {KEYS['beta']}"}
    big = json.dumps({"model": model_name, "prompt": "x" * (MAX_BODY + 1), "max_tokens": 1})
    r = httpx.post(url, content=big, headers={**auth, "content-type": "application/json"})
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["param"] == "body" and str(MAX_BODY) in err["message"]

    def chunks():  # 8 x 16 KiB, streamed with Transfer-Encoding: chunked
        yield b'{"prompt": "'
        for _ in range(8):
            yield b"x" * (16 << 10)
        yield b'", "max_tokens": 1}'

    r = httpx.post(url, content=chunks(), headers=auth)
    assert r.status_code == 413, r.text
    # a body under the limit is served; the router is healthy
    ok = {"model": model_name, "prompt": "hello", "max_tokens": 1, "user": "u" * (MAX_BODY // 2)}
    r = httpx.post(url, json=ok, headers=auth)
    assert r.status_code == 200, r.text
    assert httpx.get(cluster.http_url.removesuffix("/v1") + "/health").status_code == 200
