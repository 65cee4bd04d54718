"""One detokenizer: for the same tokens, `pdserve generate --model` (in process), gRPC (whole
and streamed) and the OpenAI HTTP API (whole and streamed, with the official client) give the
same `text`, also when the tokens are not UTF-8: a U+FFFD in the middle and a character cut
off at the end (docs/HTTP_API.md, "Text"). The cases are found, not assumed: greedy outputs
of the tiny random model are searched for such tokens, and the test fails if none exist."""

from __future__ import annotations

import argparse

import openai
import pytest

from pdserve.client import Client
from pdserve.model.tokenizer import Tokenizer

from .conftest import VOCAB, reference_tokens, start_cluster

pytestmark = pytest.mark.integration

FFFD = "\ufffd"
SEARCH_TOKENS = 24
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(serving_model_dir):
    c = start_cluster(serving_model_dir, prefill=1, decode=1, http_port=0)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def cases(serving_model_dir, reference_engine) -> dict[str, tuple[list[int], int]]:
    """name -> (prompt, max_tokens) whose greedy text has U+FFFD in the middle ("middle")
    and ends in a cut-off character ("cut")."""
    tok = Tokenizer.from_dir(serving_model_dir)
    prompts = [[3 + i, 50 + 7 * i, (200 + 11 * i) % VOCAB, 9] for i in range(40)]
    outs = reference_tokens(reference_engine, [(p, SEARCH_TOKENS) for p in prompts])
    found: dict[str, tuple[list[int], int]] = {}
    for prompt, ids in zip(prompts, outs, strict=True):
        for n in range(1, len(ids) + 1):
            text = tok.decode(ids[:n])
            if "middle" not in found and FFFD in text.rstrip(FFFD):
                found["middle"] = (prompt, n)
            if "cut" not in found and text.endswith(FFFD) and FFFD not in tok.decode(ids[: n - 1]):
                found["cut"] = (prompt, n)
    assert set(found) == {"middle", "cut"}, f"no such greedy outputs in {len(prompts)} prompts"
    return found


def _in_process(model_dir, prompt: list[int], n: int) -> dict:
    """`pdserve generate --model DIR --prompt-ids ... --temperature 0 --ignore-eos`'s path."""
    from pdserve.cli.generate import run_local

    args = argparse.Namespace(
        model=str(model_dir), dtype="float32", prompt=None,
        prompt_ids=",".join(map(str, prompt)), max_tokens=n, top_p=1.0, top_k=0, seed=None,
        **GREEDY,
    )  # fmt: skip
    return run_local(args)


@pytest.mark.parametrize("case", ["middle", "cut"])
def test_same_text_on_every_path(case, cases, cluster, serving_model_dir):
    prompt, n = cases[case]
    local = _in_process(serving_model_dir, prompt, n)
    ids, text = local["token_ids"], local["text"]
    assert len(ids) == n
    assert text == Tokenizer.from_dir(serving_model_dir).decode(ids)
    assert FFFD in text and (text.endswith(FFFD) if case == "cut" else FFFD in text.rstrip(FFFD))

    with Client(cluster.addr) as grpc_client:
        whole = grpc_client.generate(token_ids=prompt, max_tokens=n, **GREEDY)
        events = list(grpc_client.generate_stream(token_ids=prompt, max_tokens=n, **GREEDY))
    assert list(whole.token_ids) == ids
    assert whole.text == text
    assert [t for e in events for t in e.token_ids] == ids
    assert "".join(e.text for e in events) == text
    assert not any(e.text.endswith(FFFD) for e in events[:-1] if e.finish_reason is None)

    extra = {"ignore_eos": True, "return_token_ids": True}
    with openai.OpenAI(base_url=cluster.http_url, api_key="x", max_retries=0) as oai:
        model = oai.models.list().data[0].id
        r = oai.completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0.0, extra_body=extra
        )
        assert list(r.choices[0].model_extra["token_ids"]) == ids
        assert r.choices[0].text == text
        streamed = ""
        for chunk in oai.completions.create(
            model=model, prompt=prompt, max_tokens=n, temperature=0.0, stream=True,
            extra_body=extra,
        ):  # fmt: skip
            if chunk.choices:
                streamed += chunk.choices[0].text
        assert streamed == text
