"""Gemma 4 (tiny: sliding/full layers, KV-shared layers, K = V, per-layer inputs) through every
serving path on real processes: disaggregated (1P1D), colocated, and a kvstore hit (a chat over
2 prefill workers under round_robin, so turn 2 fetches the store). Tokens equal the in-process
engine, which equals transformers (checked here too, fp32 greedy).

KV bytes: only the layers that store KV move. The tiny model has 6 layers, 2 of them KV-shared
(they read layers 2 and 3): a block is 4 stored layers, never the naive 6; its K = V layer
keeps one tensor; sliding layers (window 24) send their last window only."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch

from pdserve.worker.nonce import TOKEN_MESSAGE_INT32

from .conftest import counter, mixed_requests, reference_tokens, start_cluster, wait_until
from .conftest import worker_info as info_of
from .kvreuse_helpers import Conversation, StoreProbe, reference, reuse_floor, wait_written_back

pytestmark = [pytest.mark.integration, pytest.mark.filterwarnings("ignore")]
pytest.importorskip("ucxx")

BLOCK_SIZE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from pdserve.model.tiny import TinySpec, make_tiny

    root = tmp_path_factory.mktemp("gemma4-serving")
    return Path(make_tiny(root / "g4", TinySpec(family="gemma4", vocab=512, max_pos=1024)))


@pytest.fixture(scope="module")
def engine(model_dir):
    from pdserve.engine.engine import EngineConfig, LLMEngine

    cfg = EngineConfig(model_dir=str(model_dir), dtype="float32", num_blocks=256, block_size=16)
    return LLMEngine(cfg)


def test_engine_equals_transformers(model_dir, engine):
    import transformers as tf

    ref = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ref.generation_config.eos_token_id = None
    for prompt, _ in mixed_requests(4, seed=3, max_len=60):
        with torch.no_grad():
            out = ref.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long), pad_token_id=0,
            )  # fmt: skip
        assert reference(engine, prompt, 12) == out[0, len(prompt) :].tolist()


async def _run_all(addr, requests):
    from pdserve.client import AsyncClient

    async with AsyncClient(addr, timeout=120.0) as client:
        return await asyncio.gather(
            *(
                client.generate(token_ids=p, max_tokens=m, temperature=0.0, ignore_eos=True)
                for p, m in requests
            )
        )


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_serving_matches_engine_and_moves_stored_layers_only(mode, model_dir, engine):
    kw = dict(prefill=1, decode=1) if mode == "disagg" else dict(colocated=1)
    cluster = start_cluster(model_dir, mode=mode, **kw)
    try:
        recv = next(n for n in cluster.worker_names() if n.startswith(("decode", "colocated")))
        requests = mixed_requests(12, seed=5)
        expected = reference_tokens(engine, requests)
        before = counter(cluster, recv, "ucx_bytes_received")
        results = asyncio.run(_run_all(cluster.addr, requests))
        for i, (res, ref) in enumerate(zip(results, expected, strict=True)):
            assert res.token_ids == ref, f"request {i} differs"
        received = counter(cluster, recv, "ucx_bytes_received") - before
        info = info_of(cluster, recv)
        # the sliding layers' own pool (kv/window_group.py) is full again after the burst
        window_total = counter(cluster, recv, "pool_window_total_blocks")
        wait_until(
            lambda: counter(cluster, recv, "pool_window_free_blocks") == window_total,
            what="the window pool full again",
        )
    finally:
        cluster.stop()
    # 4 stored layers of 6: sliding (2 KV heads x 16, K and V) x3 and full (1 KV head x 32,
    # K = V: V only), fp32
    sliding, full = 2 * BLOCK_SIZE * 2 * 16 * 4, 1 * BLOCK_SIZE * 1 * 32 * 4
    assert info.num_layers == 4
    assert window_total > 0
    assert info.bytes_per_block == 3 * sliding + full
    if mode == "colocated":
        assert received == 0
        return
    # sliding layers (window 24) move their last window only: blocks from
    # (n - 24) // 16 on; full layers every block
    pushed = [(p, m) for p, m in requests if m > 1]
    implied = 0
    for p, _ in pushed:
        nb, first = math.ceil(len(p) / BLOCK_SIZE), max(0, len(p) - 24) // BLOCK_SIZE
        implied += 3 * (nb - first) * sliding + nb * full
    assert any(len(p) > 24 + BLOCK_SIZE for p, _ in pushed)  # trimming happened
    assert received == implied + 4 * TOKEN_MESSAGE_INT32 * len(pushed)
    for (p, m), res in zip(requests, results, strict=True):  # per-request transfer_bytes
        if m > 1:
            nb, first = math.ceil(len(p) / BLOCK_SIZE), max(0, len(p) - 24) // BLOCK_SIZE
            assert res.usage.stages["transfer_bytes"] == 3 * (nb - first) * sliding + nb * full


def test_kvstore_hit_matches_engine(model_dir, engine):
    cluster = start_cluster(model_dir, prefill=2, decode=1, kvstore=True, policy="round_robin")
    try:
        from pdserve.client import Client

        conv, probe = Conversation(seed=4), StoreProbe(cluster)
        with Client(cluster.addr, max_retries=0) as client:
            for _ in range(3):
                conv.send(client)
                wait_written_back(probe, engine.kv_fingerprint, conv.last)
        stats = probe.stats()
    finally:
        cluster.stop()
    # a store block is the 4 stored layers (3 sliding 2x16 K and V + 1 full 1x32 V only,
    # fp32): the 2 KV-shared layers add no byte to what is published or fetched
    assert engine.spec.bytes_per_block == 3 * (2 * BLOCK_SIZE * 32 * 4) + BLOCK_SIZE * 32 * 4
    assert stats.num_blocks > 0
    assert stats.used_bytes == stats.num_blocks * engine.spec.bytes_per_block
    assert stats.bytes_in == stats.num_blocks * engine.spec.bytes_per_block  # no eviction
    assert stats.bytes_out % engine.spec.bytes_per_block == 0 and stats.bytes_out > 0
    for i, turn in enumerate(conv.turns):
        assert turn.answer == reference(engine, turn.prompt, conv.answer_tokens), f"turn {i + 1}"
    assert conv.turns[0].kvstore_tokens == 0
    assert all(t.kvstore_tokens > 0 for t in conv.turns[1:])  # fetched, then decoded right
    # the decode's trimmed transfer (sliding layers got their window only) still lets it
    # publish the answer blocks: the next turn reuses prompt + answer, not the prompt only
    for prev, turn in zip(conv.turns, conv.turns[1:], strict=False):
        assert turn.cached_tokens >= reuse_floor(len(prev.prompt), len(prev.answer))
