"""The engine on a CUDA device: greedy tokens against transformers, the flashinfer backend
against the torch reference on the same paged caches, and the engine's own tokens with each
backend. Every test skips on a machine without CUDA (`scripts/gpu-check.sh` runs them where
there is one); the flashinfer tests skip when flashinfer is not installed.

Tolerances follow tests/unit/test_model_vs_transformers.py: in fp32 greedy tokens must equal
the reference's except at a near-tie (top-2 margin under 1e-3: GPU matmuls add in another
order than the CPU reference); in bf16 a divergence is forgiven where the reference's margin
is under 0.25 (a few bf16 ulps), and the comparison stops there.
"""

from __future__ import annotations

import random

import pytest
import torch

from .model_fixtures import hf_generate, load_hf, run_paged, tiny_checkpoint, top2_margin

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.filterwarnings("ignore"),
]
NEW_TOKENS = 24
MARGIN = {"float32": 1e-3, "bfloat16": 0.25}


def _has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


needs_flashinfer = pytest.mark.skipif(not _has_flashinfer(), reason="flashinfer not installed")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "llama", family="llama", vocab=512)


def _prompts(n: int = 4, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randint(3, 500) for _ in range(rng.randint(5, 70))] for _ in range(n)]


def _backend(ckpt, name: str):
    from pdserve.model.attention import select_backend
    from pdserve.model.config import ModelConfig

    cfg = ModelConfig.from_dir(ckpt)
    return select_backend("cuda", cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, name=name)


def _check_tokens(ours: list[int], ref: list[int], ref_logits, margin: float) -> None:
    for i, (a, b) in enumerate(zip(ours, ref, strict=True)):
        if a != b:
            assert top2_margin(ref_logits[i]) < margin, f"token {i}: {a} != {b} (not a near-tie)"
            return


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("flashinfer", marks=needs_flashinfer)])
def test_greedy_tokens_match_transformers_on_cuda(ckpt, backend, dtype):
    """Staggered arrivals and 7-token chunks: steps mix prefill chunks (after cached context)
    and decodes, through block tables that are not the identity."""
    from pdserve.model.loader import load_model

    loaded = load_model(ckpt, dtype=dtype, device="cuda", backend=_backend(ckpt, backend))
    prompts = _prompts()
    runs = run_paged(loaded, prompts, NEW_TOKENS, chunk=7)
    hf = load_hf(ckpt, torch.float32)  # the reference: transformers fp32 on the CPU
    for prompt, run in zip(prompts, runs, strict=True):
        ref, ref_logits = hf_generate(hf, prompt, NEW_TOKENS)
        _check_tokens(run.tokens, ref, ref_logits, MARGIN[dtype])


@needs_flashinfer
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 8])
def test_flashinfer_paged_attention_matches_the_torch_backend(dtype, window):
    """One step of 3 decodes (contexts 1, 17, 40), a chunk of 9 after 23 cached tokens and a
    fresh 12-token prompt, on shuffled blocks: flashinfer's output equals the torch
    backend's (SDPA path) within the dtype's rounding, and both write the same K/V."""
    from pdserve.model.attention.flashinfer import FlashInferBackend
    from pdserve.model.attention.metadata import AttentionMetadata
    from pdserve.model.attention.torch import TorchAttentionBackend

    h, hkv, d, bs = 8, 2, 64, 16
    gen = torch.Generator().manual_seed(0)
    qlens, slens = [1, 1, 1, 9, 12], [1, 17, 40, 32, 12]
    need = [-(-s // bs) for s in slens]
    order = torch.randperm(sum(need) + 4, generator=gen).tolist()
    blocks = [b for b in order if b != 0][: sum(need)]
    tables, k = [], 0
    for n in need:
        tables.append(blocks[k : k + n])
        k += n
    num_blocks = max(order) + 1
    cache = (torch.randn(num_blocks, 2, bs, hkv, d, generator=gen) * 0.5).to("cuda", dtype)
    t = sum(qlens)
    q = torch.randn(t, h, d, generator=gen).to("cuda", dtype)
    kk = torch.randn(t, hkv, d, generator=gen).to("cuda", dtype)
    vv = torch.randn(t, hkv, d, generator=gen).to("cuda", dtype)
    meta = AttentionMetadata.build(qlens, slens, tables, bs, torch.device("cuda"))
    fi, ref = FlashInferBackend(h, hkv, d, "cuda"), TorchAttentionBackend(h, hkv, d)
    ref.batch_invariant = False  # the SDPA path runs on any device
    c_fi, c_ref = cache.clone(), cache.clone()
    out_fi = fi.forward(fi.prepare(meta), q, kk, vv, c_fi, window)
    out_ref = ref.forward(ref.prepare(meta), q, kk, vv, c_ref, window)
    torch.testing.assert_close(c_fi, c_ref, atol=0, rtol=0)
    tol = 2e-2 if dtype == torch.bfloat16 else 3e-3
    torch.testing.assert_close(out_fi.float(), out_ref.float(), atol=tol, rtol=tol)


@needs_flashinfer
def test_the_engine_gives_the_same_tokens_with_either_backend_on_cuda(ckpt):
    """bf16, staggered requests through the real scheduler: flashinfer and torch attention
    agree token for token except past a near-tie of the torch run."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.params import SamplingParams
    from pdserve.model.loader import load_model

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    outs = {}
    for name in ("torch", "flashinfer"):
        loaded = load_model(ckpt, dtype="bfloat16", device="cuda", backend=_backend(ckpt, name))
        cfg = EngineConfig(model_dir=str(ckpt), dtype="bfloat16", device="cuda",
                           max_num_batched_tokens=32)  # fmt: skip
        outs[name] = LLMEngine(cfg, loaded=loaded).generate(_prompts(6, seed=1), params)
    same = sum(a == b for a, b in zip(outs["torch"], outs["flashinfer"], strict=True))
    assert same >= 5, f"{same} of 6 requests identical"
