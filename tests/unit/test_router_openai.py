"""OpenAI bodies -> GenerateRequest, errors -> HTTP status and body, model names: logic only."""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    UnauthenticatedError,
    UnavailableError,
)
from pdserve.router.frontdoor.http.errors import error_body, error_response
from pdserve.router.frontdoor.http.openai import ChatRequest, CompletionRequest, Shaper, parse
from pdserve.router.frontdoor.model_info import model_name
from pdserve.v1 import router_pb2


def chat(**body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return parse(ChatRequest, body).to_request()


def completion(**body):
    body.setdefault("prompt", "hi")
    return parse(CompletionRequest, body).to_request()


def test_chat_to_request():
    req = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ],
        temperature=0,
        top_p=0.5,
        max_tokens=7,
        max_completion_tokens=9,  # wins over max_tokens, as in OpenAI's API
        stop="\n",
        seed=3,
        top_k=4,
        ignore_eos=True,
        stop_token_ids=[2],
        session_id="s1",
        user="ignored",
    )
    assert [(m.role, m.content) for m in req.chat.messages] == [
        ("system", "be brief"),
        ("user", "ab"),
    ]
    s = req.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.seed, s.top_k) == (9, 0.0, 0.5, 3, 4)
    assert s.ignore_eos and list(s.stop) == ["\n"] and list(s.stop_token_ids) == [2]
    assert req.session_id == "s1"
    assert not chat().sampling.HasField("max_tokens")  # unset: the router's default


def test_completion_prompts():
    assert completion(prompt="hello").text == "hello"
    assert list(completion(prompt=[1, 2, 3]).token_ids.ids) == [1, 2, 3]
    assert completion(prompt=["only"]).text == "only"
    assert list(completion(prompt=[[4, 5]]).token_ids.ids) == [4, 5]
    assert completion(top_k=-1).sampling.top_k == 0  # vLLM's "off"


@pytest.mark.parametrize(
    "make, body, param",
    [
        (chat, {"n": 2}, "n"),
        (chat, {"logprobs": True}, "logprobs"),
        (chat, {"top_logprobs": 2}, "logprobs"),
        (chat, {"tools": [{"type": "function"}]}, "tools"),
        (chat, {"presence_penalty": 0.5}, "presence_penalty"),
        (chat, {"messages": []}, "messages"),
        (chat, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        (chat, {"max_tokens": 0}, "max_tokens"),
        (chat, {"temperature": "hot"}, "temperature"),
        (completion, {"prompt": ""}, "prompt"),
        (completion, {"prompt": ["a", "b"]}, "prompt"),
        (completion, {"echo": True}, "echo"),
        (completion, {"suffix": "x"}, "suffix"),
        (completion, {"best_of": 2}, "best_of"),
        (completion, {"top_k": -5}, "top_k"),
    ],
)
def test_unsupported_or_bad_fields_name_the_parameter(make, body, param):
    with pytest.raises(InvalidRequestError) as info:
        make(**body)
    assert info.value.field == param


def test_body_must_be_an_object():
    with pytest.raises(InvalidRequestError):
        parse(ChatRequest, [1, 2])
    with pytest.raises(InvalidRequestError) as info:
        parse(CompletionRequest, {})
    assert info.value.field == "prompt"


@pytest.mark.parametrize(
    "exc, status, kind",
    [
        (InvalidRequestError("top_p", "must be in (0, 1]"), 400, "invalid_request_error"),
        (FailedPreconditionError("needs a tokenizer"), 400, "invalid_request_error"),
        (UnauthenticatedError("invalid API key"), 401, "authentication_error"),
        (NotFoundError("model"), 404, "not_found_error"),
        (OverloadedError("busy", retry_after_s=2.5), 429, "rate_limit_error"),
        (UnavailableError("no decode"), 503, "service_unavailable"),
        (RuntimeError("boom"), 500, "server_error"),
    ],
)
def test_error_mapping(exc, status, kind):
    got, body = error_body(exc)
    assert got == status and body["error"]["type"] == kind
    resp = error_response(exc)
    assert resp.status_code == status
    if status == 429:
        assert resp.headers["retry-after"] == "3"


def test_error_params_use_openai_names():
    _, body = error_body(InvalidRequestError("token_ids.ids", "token at index 1 is 9"))
    assert body["error"]["param"] == "prompt"
    assert body["error"]["message"] == "prompt: token at index 1 is 9"
    _, body = error_body(InvalidRequestError("prompt", "must contain at least 1 token"), chat=True)
    assert body["error"]["param"] == "messages"
    _, body = error_body(InvalidRequestError("chat", "message 0 has role 'x'"))
    assert body["error"]["param"] == "messages"
    assert body["error"]["code"] == grpc.StatusCode.INVALID_ARGUMENT.name.lower()


def test_shaper_objects():
    usage = router_pb2.Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=4)
    s = Shaper("chat", "m", "abc", ids=True)
    whole = s.whole("hi", [7, 8], 2, usage)
    assert whole["id"] == "chatcmpl-abc" and whole["object"] == "chat.completion"
    assert whole["choices"][0]["message"] == {"role": "assistant", "content": "hi"}
    assert whole["choices"][0]["finish_reason"] == "length"
    assert whole["choices"][0]["token_ids"] == [7, 8]
    assert whole["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 2,
        "total_tokens": 7,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    first = s.chunk("", [], 0, first=True)
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    t = Shaper("text", "m", "abc", ids=False)
    last = t.chunk("x", [9], 1)
    assert last["object"] == "text_completion" and last["choices"][0]["text"] == "x"
    assert last["choices"][0]["finish_reason"] == "stop" and "token_ids" not in last["choices"][0]
    assert t.usage_chunk(usage)["choices"] == []
    json.dumps(whole)  # plain JSON types only


def test_model_name_is_never_a_path(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    assert model_name(d) == "my-model"
    (d / "config.json").write_text(json.dumps({"_name_or_path": "org/Model-7B"}))
    assert model_name(d) == "org/Model-7B"
    (d / "config.json").write_text(json.dumps({"_name_or_path": "/abs/path/model"}))
    assert model_name(d) == "my-model"
    snap = tmp_path / "models--Qwen--Qwen3-0.6B" / "snapshots" / ("a" * 40)
    snap.mkdir(parents=True)
    assert model_name(snap) == "Qwen/Qwen3-0.6B"
