"""Router-side request validation: messages name the field and the range."""

import pytest

from pdserve.engine.params import SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.router.frontdoor.validation import (
    check_messages,
    check_request,
    check_session_id,
    to_params,
)
from pdserve.v1 import common_pb2


def check(tokens=(1, 2, 3), params=None, stops=(), session="", vocab=100, max_len=64):
    check_request(
        list(tokens), params or SamplingParams(max_tokens=8), list(stops), session, vocab, max_len
    )


@pytest.mark.parametrize(
    "kwargs, field, words",
    [
        ({"tokens": ()}, "prompt", "at least 1"),
        ({"tokens": (1, 100)}, "token_ids.ids", "[0, 100)"),
        ({"tokens": (-1,)}, "token_ids.ids", "[0, 100)"),
        ({"params": SamplingParams(max_tokens=0)}, "max_tokens", ">= 1"),
        ({"params": SamplingParams(max_tokens=62)}, "max_tokens", "64"),
        ({"params": SamplingParams(temperature=-0.5)}, "temperature", ">= 0"),
        ({"params": SamplingParams(top_p=0.0)}, "top_p", "(0, 1]"),
        ({"params": SamplingParams(top_p=1.5)}, "top_p", "(0, 1]"),
        ({"params": SamplingParams(top_k=-1)}, "top_k", ">= 0"),
        ({"session": "bad id!"}, "session_id", "[A-Za-z0-9_.:-]{1,128}"),
        ({"session": "x" * 129}, "session_id", "1-128"),
        ({"stops": ("",)}, "stop", "empty"),
        ({"stops": ("x" * 300,)}, "stop", "at most 256"),
        ({"stops": tuple("abcdefghijklmnopq")}, "stop", "at most 16"),
    ],
)
def test_bad_requests_name_the_field(kwargs, field, words):
    with pytest.raises(InvalidRequestError) as info:
        check(**kwargs)
    assert info.value.field == field
    assert words in str(info.value)


def test_good_request_passes():
    check(session="user-1_a.b:c", stops=("\n\n", "END"))
    check_session_id("")  # optional


def test_chat_messages():
    check_messages([("system", "be brief"), ("user", "hi")])
    with pytest.raises(InvalidRequestError, match="role 'robot'"):
        check_messages([("robot", "hi")])
    with pytest.raises(InvalidRequestError, match="at least one"):
        check_messages([])


def test_to_params_defaults_and_clamp():
    p = to_params(common_pb2.SamplingParams(), num_prompt_tokens=10, max_model_len=64)
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (54, 1.0, 1.0, 0, None)
    p = to_params(
        common_pb2.SamplingParams(max_tokens=5, temperature=0.0, seed=7, top_k=3),
        num_prompt_tokens=10,
        max_model_len=4096,
    )
    assert (p.max_tokens, p.temperature, p.seed, p.top_k) == (5, 0.0, 7, 3)
    p = to_params(common_pb2.SamplingParams(), num_prompt_tokens=10, max_model_len=4096)
    assert p.max_tokens == 128


def test_output_offset_is_the_routers_business():
    with pytest.raises(InvalidRequestError, match=r"sampling\.output_offset"):
        to_params(common_pb2.SamplingParams(output_offset=3), 4, 64)
