"""Greedy engine output == transformers greedy `generate`, every family, prompts from 1 token to
well past several block boundaries, all prompts batched together in one engine."""

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.model.loader import load_model
from tests.conftest import FAMILIES, VOCAB, assert_greedy_matches, hf_greedy

PROMPT_LENS = (1, 15, 16, 17, 50, 70)
NEW_TOKENS = 45


def prompts(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


def check_family(model_dir):
    loaded = load_model(model_dir, dtype="float32")
    engine = LLMEngine(
        EngineConfig(model_dir, num_blocks=128, block_size=16, max_num_batched_tokens=64),
        loaded=loaded,
    )
    ps = prompts()
    outs = engine.generate(
        ps, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    )
    for p, out in zip(ps, outs, strict=True):
        assert len(out) == NEW_TOKENS
        ref, ref_logits = hf_greedy(model_dir, p, NEW_TOKENS)
        assert_greedy_matches(out, ref, ref_logits)
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_hf_checkpoint(hf_checkpoints, family):
    check_family(hf_checkpoints[family])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers_make_tiny(make_tiny_dirs, family):
    check_family(make_tiny_dirs[family])
