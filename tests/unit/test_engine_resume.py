"""A stream resumed from (prompt + its first k tokens) with output_offset=k and the remaining
max_tokens continues with exactly the tokens of the uninterrupted run: what the router relies
on when it migrates a request to another worker. Greedy and seeded sampling."""

from dataclasses import replace

import pytest
import torch

from pdserve.engine.params import SamplingParams


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=24, temperature=1.2, top_k=40, seed=12345, ignore_eos=True),
    ],
    ids=["greedy", "seeded-top-p", "seeded-top-k"],
)
def test_resume_with_output_offset_equals_uninterrupted(make_engine, params):
    engine = make_engine()
    p = prompt(29, seed=3)
    ref = engine.generate([p], params)[0]
    assert len(ref) == params.max_tokens
    for k in (1, 2, 15, 23):
        resumed = replace(params, max_tokens=params.max_tokens - k, output_offset=k)
        assert ref[:k] + engine.generate([p + ref[:k]], resumed)[0] == ref, f"k={k}"


def test_without_the_offset_seeded_draws_differ(make_engine):
    """The offset is needed: restarting the index at 0 repeats the first draws instead."""
    engine = make_engine()
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=99, ignore_eos=True)
    p = prompt(20, seed=5)
    ref = engine.generate([p], params)[0]
    k = 4
    naive = engine.generate([p + ref[:k]], replace(params, max_tokens=16 - k))[0]
    assert ref[:k] + naive != ref


def test_output_offset_is_validated():
    from pdserve.engine.params import validate_params
    from pdserve.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="output_offset"):
        validate_params(SamplingParams(output_offset=-1))
