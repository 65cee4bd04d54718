"""The fused bf16 pointwise kernels (pdserve.model.pointwise, csrc/bf16_pointwise.cpp): the
same roundings as the torch chains they replace, row-invariant, chunking-invariant in the
model, and what a bf16 CPU model runs. Skipped, with the reason, where the CPU has no AVX-512 or
the kernels are not built (no compiler)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import llama, pointwise
from pdserve.model.kernel_settings import KernelSettings
from pdserve.model.kernels import select_kernels
from pdserve.model.pointwise import FusedBf16Pointwise, TorchPointwise
from tests.unit.kernel_skip import unless_loads

pytestmark = unless_loads(pointwise.KERNEL)

BF16 = torch.bfloat16


class _Norm:
    def __init__(self, h: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.weight = (torch.randn(h, generator=g) * 0.3 + 1).to(BF16)
        self.eps = 1e-6


def _ops() -> tuple[TorchPointwise, FusedBf16Pointwise]:
    return TorchPointwise(), FusedBf16Pointwise(pointwise.load())


def _rand(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(BF16)


@pytest.mark.parametrize("h", [512, 80, 1000, 7])
def test_add_norm_matches_the_torch_chain(h):
    torch_ops, fused = _ops()
    norm = _Norm(h, h)
    x, d = _rand(300, h, scale=3.0, seed=1), _rand(300, h, seed=2)
    xt, yt = torch_ops.add_norm(x.clone(), d, norm)
    xf, yf = fused.add_norm(x.clone(), d, norm)
    assert torch.equal(xf, xt)  # the residual add: the same rounding, bit for bit
    # the norm: at most the last fp32 ulp of the sum differs, so a rare bf16 ulp
    diff = (yf.float() - yt.float()).abs()
    ulp = yt.float().abs() * 2.0**-7
    assert bool((diff <= ulp).all())
    assert (yf != yt).float().mean() < 1e-3
    _, yf = fused.add_norm(x.clone(), None, norm)  # no delta: the norm alone
    assert (yf != torch_ops.add_norm(x, None, norm)[1]).float().mean() < 1e-3


def test_add_norm_updates_the_residual_in_place():
    _, fused = _ops()
    x, d = _rand(5, 64, seed=3), _rand(5, 64, seed=4)
    expected = (x.float() + d.float()).to(BF16)
    ptr = x.data_ptr()
    x_out, _ = fused.add_norm(x, d, _Norm(64, 0))
    assert x_out.data_ptr() == ptr and torch.equal(x, expected)


@pytest.mark.parametrize("inter", [2048, 40, 1000])
def test_silu_mul_matches_the_torch_chain(inter):
    torch_ops, fused = _ops()
    gu = _rand(200, 2 * inter, scale=4.0, seed=inter)
    a, b = torch_ops.silu_mul(gu), fused.silu_mul(gu)
    assert a.shape == b.shape == (200, inter)
    diff = (a.float() - b.float()).abs()
    assert bool((diff <= a.float().abs() * 2.0**-7 + 1e-30).all())
    assert (a != b).float().mean() < 1e-3


@pytest.mark.parametrize(("h", "hkv", "d"), [(8, 2, 64), (4, 4, 80), (2, 1, 128), (3, 1, 18)])
def test_rope_is_bit_identical_to_the_torch_chain(h, hkv, d):
    torch_ops, fused = _ops()
    t = 37
    qkv = _rand(t, (h + 2 * hkv) * d, seed=d)
    cos, sin = _rand(t, 1, d, seed=5), _rand(t, 1, d, seed=6)
    qt, kt = torch_ops.rope_qk(qkv, cos, sin, h, hkv, d)
    qf, kf = fused.rope_qk(qkv, cos, sin, h, hkv, d)
    assert torch.equal(qf, qt) and torch.equal(kf, kt)
    assert qf.is_contiguous() and kf.is_contiguous()


def test_every_op_gives_a_row_the_same_bits_alone_and_in_a_batch_with_any_threads():
    _, fused = _ops()
    norm = _Norm(512, 7)
    x, d = _rand(300, 512, seed=8), _rand(300, 512, seed=9)
    gu = _rand(300, 4096, scale=3.0, seed=10)
    qkv = _rand(300, 768, seed=11)
    cos, sin = _rand(300, 1, 64, seed=12), _rand(300, 1, 64, seed=13)

    def run(rows: slice) -> list[torch.Tensor]:
        xr = x[rows].clone()
        _, y = fused.add_norm(xr, d[rows], norm)
        q, k = fused.rope_qk(qkv[rows], cos[rows], sin[rows], 8, 2, 64)
        return [xr, y, fused.silu_mul(gu[rows]), q, k]

    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2):
            torch.set_num_threads(n)
            batch = run(slice(0, 300))
            for i in (0, 1, 150, 299):
                alone = run(slice(i, i + 1))
                for a, b in zip(alone, batch, strict=True):
                    assert torch.equal(a[0], b[i]), f"row {i}, {n} thread(s)"
            results.append(batch)
        for a, b in zip(*results, strict=True):
            assert torch.equal(a, b)
    finally:
        torch.set_num_threads(threads)


def test_the_selection_picks_the_kernels_for_bf16_on_cpu_only():
    def ops(dtype: torch.dtype, settings: KernelSettings = KernelSettings()) -> TorchPointwise:
        return pointwise.ops(select_kernels(settings, dtype, "cpu", True).pointwise)

    assert ops(BF16).fused
    assert not ops(torch.float32).fused
    assert not ops(BF16, KernelSettings.from_env({"PDSERVE_BF16_POINTWISE": "0"})).fused


def test_a_chunked_mlp_gives_the_unchunked_bits(monkeypatch):
    """DecoderLayer.mlp splits a long step into row chunks on the fused path: no bit moves."""
    torch.manual_seed(0)
    layer = torch.nn.Module()
    layer.gate_up_proj = torch.nn.Linear(64, 2 * 96, bias=False).to(BF16)
    layer.down_proj = torch.nn.Linear(96, 64, bias=False).to(BF16)
    from pdserve.model.cpu_linear import pack_linears

    pack_linears(layer, batch_invariant=True)  # the row-invariant linears a bf16 engine runs
    layer.silu_gate_up = lambda h, ops: llama.DecoderLayer.silu_gate_up(layer, h, ops)
    h = _rand(50, 64, seed=14)
    fused = _ops()[1]
    mlp = llama.DecoderLayer.mlp
    whole = mlp(layer, h, fused)
    monkeypatch.setattr(llama, "MLP_CHUNK_ROWS", 7)
    assert torch.equal(mlp(layer, h, fused), whole)
