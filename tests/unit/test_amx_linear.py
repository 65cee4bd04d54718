"""The AMX bf16 linear (pdserve.model.amx_linear): invariant by construction, correct, and what
`pack_linears` serves on a CPU with AMX. Skipped, with the reason, where the CPU has no AMX, the
kernel is not built (no compiler) or the OS refuses AMX.

Why it exists is measured here too: on a CPU with AMX, oneDNN's packed bf16 linear gives a
row other bits inside a batch than alone (`test_onednn_bf16_is_batch_variant_on_this_cpu`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import amx_linear
from pdserve.model.cpu_linear import PackedLinear, pack_linears
from tests.unit.kernel_skip import unless_loads

pytestmark = unless_loads(amx_linear.KERNEL)

BF16 = torch.bfloat16
# (K, N, bias): a tail in K and N, bench50m's MLP down projection, a tied-head-like shape
SHAPES = [(100, 37, True), (2048, 512, False), (512, 1000, True)]


def _layer(k: int, n: int, bias: bool) -> tuple[nn.Linear, amx_linear.AmxLinear]:
    torch.manual_seed(k + n)
    lin = nn.Linear(k, n, bias=bias).to(BF16)
    return lin, amx_linear.AmxLinear.from_linear(lin)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_has_the_same_bits_alone_anywhere_in_a_batch_and_under_two_threads(shape):
    _, amx = _layer(*shape)
    x = torch.randn(300, shape[0]).to(BF16)
    with torch.inference_mode():
        alone = torch.cat([amx(x[i : i + 1]) for i in (0, 15, 16, 31, 32, 299)])
        for m in (2, 16, 17, 33, 64, 300):
            assert torch.equal(amx(x[:m])[:1], alone[:1]), f"row 0 of {m}"
        full = amx(x)
        assert torch.equal(full[[0, 15, 16, 31, 32, 299]], alone)  # every tile position
        assert torch.equal(amx(torch.cat([x[1:9], x[:1]]))[-1:], alone[:1])
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            assert torch.equal(amx(x), full)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", SHAPES)
def test_it_computes_the_linear(shape):
    lin, amx = _layer(*shape)
    x = torch.randn(40, shape[0]).to(BF16)
    bias = None if lin.bias is None else lin.bias.float()
    with torch.inference_mode():
        ref = F.linear(x.float(), lin.weight.float(), bias)
        got = amx(x.view(4, 10, -1)).view(40, -1).float()  # leading dims kept
    assert got.shape == ref.shape
    # bf16 output: one rounding of an fp32 sum (relative error ~2^-9)
    assert torch.allclose(got, ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())


def test_pack_linears_serves_bf16_on_amx_and_keeps_onednn_when_not_invariant():
    torch.manual_seed(0)

    def model():
        return nn.Sequential(nn.Linear(64, 96).to(BF16), nn.Linear(96, 64).float())

    inv, var = model(), model()
    pack_linears(inv, batch_invariant=True)
    pack_linears(var, batch_invariant=False)
    assert isinstance(inv[0], amx_linear.AmxLinear) and isinstance(inv[1], PackedLinear)
    assert isinstance(var[0], PackedLinear) and isinstance(var[1], PackedLinear)


def test_a_tied_bf16_head_gets_the_kernel(tmp_path):
    from pdserve.model.loader import load_model
    from pdserve.model.tiny import TinySpec, make_tiny

    spec = TinySpec(hidden=256, vocab=1000, tie=True)
    model = load_model(make_tiny(tmp_path / "m", spec), "bfloat16").model
    pack_linears(model, batch_invariant=True)
    assert isinstance(model.tied_head, amx_linear.AmxLinear)  # rows: test_batch_invariant_ops
    h = torch.randn(8, 256).to(BF16)
    with torch.inference_mode():
        ref = F.linear(h.float(), model.embed_tokens.weight.float())
        assert torch.allclose(model.compute_logits(h), ref, rtol=8e-3, atol=0.05)


def test_bad_input_names_the_problem():
    _, amx = _layer(64, 32, False)
    with pytest.raises(RuntimeError, match="x must be"):
        amx(torch.randn(2, 64))  # fp32
    with pytest.raises(RuntimeError, match="K or n does not match"):
        amx(torch.randn(2, 96).to(BF16))
    assert amx(torch.randn(0, 64).to(BF16)).shape == (0, 32)


def test_onednn_bf16_is_batch_variant_on_this_cpu():
    """The reason for the kernel (a probe, not a requirement): the packed oneDNN bf16 linear
    gives some row other bits inside a batch. Skips on a CPU where oneDNN happens not to."""
    torch.manual_seed(0)
    lin = nn.Linear(2048, 512, bias=False).to(BF16)
    packed = PackedLinear(lin)
    x = torch.randn(300, 2048).to(BF16)
    with torch.inference_mode():
        full = packed(x)
        alone = torch.cat([packed(x[i : i + 1]) for i in range(300)])
        differs = not torch.equal(full, alone)
    if not differs:
        pytest.skip("oneDNN's bf16 linear is row-invariant at this shape on this CPU")
    amx = amx_linear.AmxLinear.from_linear(lin)
    with torch.inference_mode():
        assert torch.equal(amx(x), torch.cat([amx(x[i : i + 1]) for i in range(300)]))
