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
from .kvreuse_helpers import (
    Conversation,
    StoreProbe,
    block_hashes_of,
    reference,
    reuse_floor,
    wait_written_back,
    written_back_blocks,
)

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
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine

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


def _published_parts(conv: Conversation, t: int) -> set[int]:
    """Blocks whose window part the store holds after a chat: every publish of N blocks (the
    prefill: its prompt's full blocks; the decode: prompt + answer but the last token) puts
    window parts for its last t blocks [N - t, N) (kv/store_parts.py)."""
    out: set[int] = set()
    for turn in conv.turns:
        context = len(turn.prompt) + len(turn.answer)
        for n in (len(turn.prompt) // BLOCK_SIZE, written_back_blocks(context)):
            out |= set(range(max(0, n - t), n))
    return out


def test_kvstore_hit_matches_engine(model_dir, engine):
    """A 3-turn chat over 2 prefill workers (round_robin: turns 2 and 3 fetch the store). The
    store keeps main parts (the full-attention layer) of every block and window parts (the 3
    sliding layers) of the last ceil(24 / 16) + 1 = 3 blocks of each publish only: its
    `used_bytes` is the footprint's "store" figure of the chat's chain plus the window parts
    that earlier publishes left behind, byte for byte. Then prompts that diverge from the
    chat before its last window fall back to the largest hit whose window is stored (or a
    miss), and still decode exactly."""
    from pdserve.kv import store_parts
    from pdserve.kv.footprint import kv_bytes, layers_of

    spec = engine.spec
    t = store_parts.window_blocks(spec)
    main_b, win_b = store_parts.part_bytes(spec)
    # main part: the full layer (1 KV head x 32, K = V: V only); window part: 3 sliding
    # layers (2 KV heads x 16, K and V), fp32; the 2 KV-shared layers add no byte
    assert (t, main_b, win_b) == (3, BLOCK_SIZE * 32 * 4, 3 * (2 * BLOCK_SIZE * 32 * 4))
    cluster = start_cluster(model_dir, prefill=2, decode=1, kvstore=True, policy="round_robin")
    fp = engine.kv_fingerprint
    try:
        from pdserve.client import Client

        # turns long enough that a publish's window is a part of its chain
        conv = Conversation(seed=4, first_tokens=100, user_tokens=70)
        probe = StoreProbe(cluster)
        with Client(cluster.addr, max_retries=0) as client:
            for _ in range(3):
                conv.send(client)
                wait_written_back(probe, fp, conv.last, window_blocks=t)
            n_main = written_back_blocks(len(conv.last))
            parts = _published_parts(conv, t)
            tail = set(range(n_main - t, n_main))
            layers = layers_of(engine.loaded.config)
            want = kv_bytes(layers, n_main * BLOCK_SIZE, 4, BLOCK_SIZE, "store")
            want += win_b * len(parts - tail)  # earlier turns' window parts (LRU keeps them)
            wait_until(lambda: probe.stats().used_bytes == want, what=f"{want} B stored")
            stats = probe.stats()
            # diverge inside block d: the store's hit is the largest k <= d with window
            # parts [k - t, k), whatever the main chain holds beyond
            diverging = []
            for d in (13, 8, 2):
                k = next((k for k in range(d, 0, -1) if set(range(max(0, k - t), k)) <= parts), 0)
                prompt = [*conv.last[: d * BLOCK_SIZE + 5], 7, 9, 11]
                assert probe.lookup(fp, block_hashes_of(fp, prompt), t) == k
                res = client.generate(
                    token_ids=prompt, max_tokens=8, temperature=0.0, ignore_eos=True
                )
                diverging.append((prompt, k, list(res.token_ids), res.cached_tokens))
    finally:
        cluster.stop()
    assert n_main == 17 and len(parts) == 11  # 6 window parts fewer than whole blocks
    assert stats.num_blocks == n_main + len(parts)
    assert stats.used_bytes == n_main * main_b + len(parts) * win_b
    assert stats.bytes_in == stats.used_bytes  # no eviction
    assert stats.bytes_out > 0
    assert stats.used_bytes < n_main * spec.bytes_per_block  # less than whole blocks
    for i, turn in enumerate(conv.turns):
        assert turn.answer == reference(engine, turn.prompt, conv.answer_tokens), f"turn {i + 1}"
    assert conv.turns[0].kvstore_tokens == 0
    assert all(t.kvstore_tokens > 0 for t in conv.turns[1:])  # fetched, then decoded right
    # the decode's trimmed transfer (sliding layers got their window only) still lets it
    # publish the answer blocks: the next turn reuses prompt + answer, not the prompt only
    for prev, turn in zip(conv.turns, conv.turns[1:], strict=False):
        assert turn.cached_tokens >= reuse_floor(len(prev.prompt), len(prev.answer))
    assert [k for _, k, _, _ in diverging] == [12, 7, 0]  # shorter hits, then a miss
    for prompt, _, tokens, cached in diverging:
        assert tokens == reference(engine, prompt, 8)
        assert cached <= len(prompt) - 3 - 5  # never past the divergence's block
