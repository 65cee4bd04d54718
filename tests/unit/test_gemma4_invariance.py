"""Gemma 4's K = V layers are batch-invariant on the default path: a sequence's output rows
are the same bits alone or beside another sequence, in one chunk or two, and as a decode row
or inside a prefill (bf16, model forward over the paged cache). With the K = V layers alone on SDPA the same
check fails."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.model.attention import AttentionMetadata
from pdserve.model.tiny import TinySpec, make_tiny

BS = 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp("g4inv") / "m", TinySpec(family="gemma4", vocab=512))
    return LLMEngine(EngineConfig(str(path), dtype="bfloat16", num_blocks=64, window_pool=False))


def forward(engine, parts):
    """parts: (tokens, start, table) per sequence: its tokens at positions start.. in one step.
    Returns each sequence's output rows."""
    runner = engine.runner
    ids, pos, ql, sl, tables = [], [], [], [], []
    for toks, start, table in parts:
        ids += toks
        pos += range(start, start + len(toks))
        ql.append(len(toks))
        sl.append(start + len(toks))
        tables.append(table)
    meta = AttentionMetadata.build(ql, sl, tables, BS)
    with torch.inference_mode():
        h = runner.model(torch.tensor(ids), torch.tensor(pos), runner.kv_caches, meta)
    out, at = [], 0
    for q in ql:
        out.append(h[at : at + q].clone())
        at += q
    return out


def paths_agree(engine) -> bool:
    g = torch.Generator().manual_seed(0)
    a = torch.randint(2, 500, (41,), generator=g).tolist()
    b = torch.randint(2, 500, (70,), generator=g).tolist()
    ta, tb = [1, 2, 3], [4, 5, 6, 7, 8]
    whole = forward(engine, [(a, 0, ta)])[0]  # 41 rows
    beside = forward(engine, [(b, 0, tb), (a, 0, ta)])[1]
    first = forward(engine, [(a[:24], 0, ta)])[0]
    second = forward(engine, [(b[:30], 0, tb), (a[24:], 24, ta)])[1]
    forward(engine, [(a[:40], 0, ta)])
    decode = forward(engine, [(b[:50], 0, tb), (a[40:], 40, ta)])[1]  # a's last row: a decode
    return (
        torch.equal(whole, beside)
        and torch.equal(whole[:24], first)
        and torch.equal(whole[24:], second)
        and torch.equal(whole[40:], decode)
    )


def test_keqv_layers_are_batch_invariant_by_default(engine):
    model = engine.runner.model
    assert any(model.keqv), "the tiny Gemma 4 has K = V layers"
    assert model.batch_invariant
    assert paths_agree(engine)


def test_keqv_layers_on_sdpa_alone_break_it(engine):
    """Only the K = V layers on SDPA (every other layer still invariant): the rows differ,
    so the K = V layers' own path is what makes the check pass."""
    model = engine.runner.model
    try:
        model.batch_invariant = False  # read by the K = V layers only; backends untouched
        assert not paths_agree(engine)
    finally:
        model.set_batch_invariant(True)
