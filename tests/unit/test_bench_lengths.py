"""The length workload of `bench serve --lengths` and how the load generator sends it."""

import asyncio
import gzip
import json

import pytest

from pdserve.bench.loadgen import send_one
from pdserve.workload.lengths import length_requests


def write_rows(path, rows):
    with gzip.open(path, "wt") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


ROWS = [
    {
        "id": f"s/{i}/{m}",
        "prompt": f"prompt number {i} " * 20,
        "model_canonical": m,
        "prompt_split": "val" if i % 2 else "train",
        "response_tokens_cl100k": 100 * (i + 1),
    }
    for i in range(10)
    for m in ("m1", "m2")
]


def test_length_requests_pick_a_models_real_lengths(tmp_path):
    path = tmp_path / "l.jsonl.gz"
    write_rows(path, ROWS)
    reqs = length_requests(str(path), "m1", 10, split="val", scale=0.1, max_prompt_chars=30)
    assert len(reqs) == 5  # only m1's val rows
    by_len = {r.max_tokens for r in reqs}
    assert by_len == {20, 40, 60, 80, 100}  # (i+1)*100*0.1 for odd i
    for r in reqs:
        assert r.prompt_text and len(r.prompt_text) <= 30 and r.prompt_ids == []
        assert r.oracle_tokens == r.max_tokens
    again = length_requests(str(path), "m1", 10, split="val", scale=0.1, max_prompt_chars=30)
    assert [(r.prompt_text, r.max_tokens) for r in again] == [
        (r.prompt_text, r.max_tokens) for r in reqs
    ]
    capped = length_requests(str(path), "any", 3, split="", scale=1.0, max_output=150)
    assert len(capped) == 3 and all(r.max_tokens <= 150 for r in capped)
    with pytest.raises(ValueError, match="no rows"):
        length_requests(str(path), "nobody", 3)


class FakeClient:
    def __init__(self) -> None:
        self.kwargs = None

    async def generate_stream(self, **kwargs):
        self.kwargs = kwargs
        yield {"token_ids": [5, 6], "finish_reason": None}
        yield {
            "token_ids": [7],
            "finish_reason": "length",
            "usage": {"prompt_tokens": 42, "stages": {}},
        }


def test_text_prompts_and_oracle_lengths_are_sent():
    from pdserve.workload.requests import BenchRequest

    client = FakeClient()
    req = BenchRequest(0, [], 3, prompt_text="hello", oracle_tokens=3)
    rec = asyncio.run(send_one(client, req, 0.0))
    assert client.kwargs["prompt"] == "hello" and "token_ids" not in client.kwargs
    assert client.kwargs["oracle_tokens"] == 3 and client.kwargs["ignore_eos"]
    assert rec.n_out == 3 and rec.n_in == 42  # the router's count of the text's tokens
