"""Op by op: the same row alone and inside batches gives the same bits (the batch-invariance
probe of every op whose result could depend on the batch), and the old kernels do not.

Attention: one sequence's queries attended (a) as the whole prompt, (b) in chunks, (c) as
decode rows batched with longer neighbours (padding), under 1 and 2 threads: bitwise equal,
and close to SDPA (the math is right). Linear: packed rows 1..300, bf16 and fp32, on whichever
kernel the selection (`pdserve.model.kernels`) serves on this CPU (oneDNN, AMX or AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.attention import fixed
from pdserve.model.cpu_linear import (
    FP32_MIN_ROWS,
    PackedLinear,
    linear_kind,
    pack_linears,
    packing_supported,
)
from pdserve.model.kernel_settings import KernelSettings
from pdserve.model.kernels import select_kernels

DTYPES = (torch.bfloat16, torch.float32)


def _qkv(dtype, s=150, h=4, hkv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(s, n, d, generator=g).to(dtype) for n in (h, hkv, hkv))
    return q, k, v


def _decode_batch(q, k, v, positions, neighbour_lens, window=None):
    """Queries at `positions` as decode rows of one batch, padded to the longest neighbour."""
    g = torch.Generator().manual_seed(1)
    hkv, d = k.shape[1:]
    lens = [p + 1 for p in positions] + list(neighbour_lens)
    s = fixed.padded_len(max(lens))
    kb = torch.randn(len(lens), hkv, s, d, generator=g).to(k.dtype)
    vb = torch.randn(len(lens), hkv, s, d, generator=g).to(k.dtype)
    qb = torch.randn(len(lens), q.shape[1], d, generator=g).to(q.dtype)
    for i, p in enumerate(positions):
        kb[i, :, : p + 1], vb[i, :, : p + 1] = (
            k[: p + 1].transpose(0, 1),
            v[: p + 1].transpose(0, 1),
        )
        qb[i] = q[p]
    ln = torch.tensor(lens)
    bias = fixed.tile_bias((ln - 1)[:, None], s, ln, window)
    o = fixed.attend(qb.view(len(lens), hkv, 1, -1, d), kb, vb, bias, 0.25)
    return o.reshape(len(lens), -1, d)[: len(positions)].to(q.dtype)


@pytest.mark.parametrize("window", [None, 24])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_is_invariant_to_chunking_padding_decode_and_threads(dtype, window):
    q, k, v = _qkv(dtype)
    n = q.shape[0]
    full = fixed.attend_sequence(q, k, v, window, 0.25)
    for cut in (1, 7, 63, 64, 65, 149):  # second chunk: queries cut.. against the cache
        part = fixed.attend_sequence(q[cut:], k, v, window, 0.25)
        assert torch.equal(part, full[cut:]), f"chunk at {cut}"
    positions = [0, 5, 63, 64, 100, n - 1]
    for neighbours in ((), (1,), (200,), (129, 300, 7)):
        dec = _decode_batch(q, k, v, positions, neighbours, window)
        assert torch.equal(dec, full[positions]), f"decode next to {neighbours}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        assert torch.equal(fixed.attend_sequence(q, k, v, window, 0.25), full)
    finally:
        torch.set_num_threads(threads)
    # the math: SDPA on the same inputs (fp32 reference)
    qpos, kpos = torch.arange(n)[:, None], torch.arange(n)[None]
    vis = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
    ref = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None],
        k.float().transpose(0, 1)[None],
        v.float().transpose(0, 1)[None],
        attn_mask=vis,
        scale=0.25,
        enable_gqa=True,
    )[0].transpose(0, 1)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(full.float(), ref, atol=tol, rtol=tol)


def test_long_prompt_query_blocks_do_not_change_results():
    q, k, v = _qkv(torch.float32, s=fixed.Q_BLOCK + 70)
    full = fixed.attend_sequence(q, k, v, None, 0.25)
    tail = fixed.attend_sequence(q[-40:], k, v, None, 0.25)  # one block, other tile count
    assert torch.equal(tail, full[-40:])


def test_sdpa_is_not_batch_invariant():
    """Why attention.fixed exists: SDPA's result for a decode row depends on the padding its
    batch neighbours impose (it picks the key split from the key length)."""
    q, k, v = _qkv(torch.float32, s=300, h=2, hkv=2)
    qd = q[-1][None, :, None]  # [1, H, 1, D]
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]

    def padded(s):
        kp = torch.cat([kt, torch.zeros(1, 2, s - 300, 16)], 2)
        vp = torch.cat([vt, torch.zeros(1, 2, s - 300, 16)], 2)
        m = (torch.arange(s) < 300)[None, None, None]
        return F.scaled_dot_product_attention(qd, kp, vp, attn_mask=m, scale=0.25)

    outs = [padded(s) for s in (300, 333, 700)]
    assert not all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape", [(64, 96, True), (2048, 128, False), (512, 1000, True), (2048, 512, False)]
)
def test_packed_linear_rows_are_invariant(dtype, shape):
    if not packing_supported(dtype):
        pytest.skip("oneDNN packing unavailable")
    k, n, bias = shape
    torch.manual_seed(0)
    # bf16 on a CPU with AMX: the AMX kernel (test_amx_linear.py); with AVX512-BF16 and no
    # AMX: the AVX512-BF16 kernel (test_avx512_bf16_linear.py); oneDNN is not invariant on either
    sel = select_kernels(KernelSettings.from_env(), dtype, "cpu", True)
    if sel.warning:
        pytest.skip(f"not invariant here: {sel.warning}")
    model = nn.Sequential(nn.Linear(k, n, bias=bias).to(dtype))
    pack_linears(model, batch_invariant=True, kernel=sel.linear)
    lin = model[0]
    assert linear_kind(model) == sel.linear
    x = torch.randn(300, k).to(dtype)
    with torch.inference_mode():
        ref = lin(x[:1])
        for m in (2, 3, 4, 7, 64, 300):
            assert torch.equal(lin(x[:m])[:1], ref), f"rows {m}"
        assert torch.equal(lin(torch.cat([x[1:9], x[:1]]))[-1:], ref)  # row position
        alone = torch.cat([lin(x[i : i + 1]) for i in range(300)])
        assert torch.equal(lin(x), alone)  # every row of 300 (tiles, the M tail) as alone


def test_fp32_single_row_kernel_differs_without_padding():
    """The old path: oneDNN's fp32 one-row kernel sums in another order for in_features 2048
    (what min_rows >= 2 removes; 2 and FP32_MIN_ROWS give the same bits)."""
    if not packing_supported(torch.float32):
        pytest.skip("oneDNN packing unavailable")
    torch.manual_seed(0)
    lin = nn.Linear(2048, 512).float()
    x = torch.randn(8, 2048)
    old, two = PackedLinear(lin), PackedLinear(lin, min_rows=2)
    four = PackedLinear(lin, min_rows=FP32_MIN_ROWS)
    with torch.inference_mode():
        assert not torch.equal(old(x[:1]), old(x[:8])[:1])
        assert torch.equal(two(x[:1]), two(x[:8])[:1])
        assert torch.equal(four(x[:1]), two(x[:1]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_tied_head_rows_are_invariant(dtype, tmp_path):
    """The logits of a tied head, as an invariant engine packs it (a packed copy of the
    embedding: plain MKL fp32 on a Xeon gives 64 rows other bits than 1-5, padding or not)."""
    from pdserve.model.loader import load_model
    from pdserve.model.tiny import TinySpec, make_tiny

    if not packing_supported(dtype):
        pytest.skip("oneDNN packing unavailable")
    spec = TinySpec(hidden=256, vocab=1000, tie=True)
    model = load_model(make_tiny(tmp_path / "m", spec), dtype).model
    pack_linears(model, batch_invariant=True)
    assert model.tied_head is not None
    torch.manual_seed(0)
    x = torch.randn(64, 256).to(dtype)
    with torch.inference_mode():
        ref = model.compute_logits(x[:1])
        for m in (2, 3, 5, 64):
            assert torch.equal(model.compute_logits(x[:m])[:1], ref), f"rows {m}"
        assert torch.equal(model.compute_logits(x)[-1:], model.compute_logits(x[-1:]))


def test_worker_flag_and_engine_config_reach_the_runner(monkeypatch, tmp_path):
    """`--no-batch-invariant` / PDSERVE_BATCH_INVARIANT=0 -> EngineConfig -> attention + linears."""
    from pdserve.config import load_settings
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.model.tiny import TinySpec, make_tiny
    from pdserve.worker.settings import WorkerSettings

    assert load_settings(WorkerSettings, []).batch_invariant is True
    assert load_settings(WorkerSettings, ["--no-batch-invariant"]).batch_invariant is False
    monkeypatch.setenv("PDSERVE_BATCH_INVARIANT", "0")
    assert load_settings(WorkerSettings, []).batch_invariant is False
    model = make_tiny(tmp_path / "m", TinySpec(vocab=512, intermediate=2048))
    for flag in (False, True):
        e = LLMEngine(EngineConfig(model, dtype="float32", num_blocks=8, batch_invariant=flag))
        assert e.runner.model.attn_backend.batch_invariant is flag
        rows = {m.min_rows for m in e.runner.model.modules() if isinstance(m, PackedLinear)}
        assert rows == ({FP32_MIN_ROWS} if flag else {1}) or not packing_supported(torch.float32)
