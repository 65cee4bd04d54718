import pytest

from pdserve.engine.params import SamplingParams, validate_request
from pdserve.errors import InvalidRequestError


def check(prompt, field, **kw):
    with pytest.raises(InvalidRequestError) as ei:
        validate_request(prompt, SamplingParams(**kw), vocab_size=100, max_model_len=64)
    assert ei.value.field == field
    assert field in str(ei.value)
    return str(ei.value)


def test_valid_request_passes():
    validate_request([1, 2, 3], SamplingParams(max_tokens=61), vocab_size=100, max_model_len=64)


def test_empty_prompt():
    check([], "prompt")


def test_token_out_of_range():
    msg = check([1, 100], "prompt_token_ids")
    assert "[0, 100)" in msg
    check([-1], "prompt_token_ids")


def test_context_length():
    msg = check([1] * 10, "max_tokens", max_tokens=55)
    assert "64" in msg


@pytest.mark.parametrize(
    "field,kw,range_text",
    [
        ("max_tokens", {"max_tokens": 0}, ">= 1"),
        ("temperature", {"temperature": -0.1}, ">= 0"),
        ("top_p", {"top_p": 0.0}, "(0, 1]"),
        ("top_p", {"top_p": 1.5}, "(0, 1]"),
        ("top_k", {"top_k": -1}, ">= 0"),
    ],
)
def test_param_ranges(field, kw, range_text):
    assert range_text in check([1], field, **kw)
