"""The AVX512-BF16 bf16 linear (pdserve.model.avx512_bf16_linear): invariant by construction,
correct, and what `pack_linears` serves when the selection (`pdserve.model.kernels`) picks it:
an invariant bf16 engine on a CPU with AVX512-BF16 and no AMX. Skipped, with the reason, where
the CPU has no AVX512-BF16 or the kernel is not built (no compiler).

Why it exists is probed here too: on this repository's AMD EPYC, oneDNN's packed bf16 linear
gives a row other bits inside a batch than alone (`test_onednn_bf16_is_batch_variant_...`)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model import avx512_bf16_linear, pointwise
from pdserve.model.avx512_bf16_linear import Avx512Bf16Linear
from pdserve.model.cpu import CpuFeatures
from pdserve.model.cpu_linear import PackedLinear, pack_linears
from pdserve.model.kernel_settings import KernelSettings
from pdserve.model.kernels import select_kernels
from tests.unit.kernel_skip import require, unless_loads

pytestmark = unless_loads(avx512_bf16_linear.KERNEL)
ZEN4 = CpuFeatures(avx512=True, avx512_bf16=True, amx=False)  # the CPU it is served on

BF16 = torch.bfloat16
ROWS = (1, 2, 3, 5, 17, 64, 300)
# (K, N, bias): tails in K (odd, not a multiple of 32) and N (not a multiple of 16 / 64),
# bench50m's qkv and MLP down projection
SHAPES = [(100, 37, True), (33, 130, False), (257, 70, True), (512, 768, False), (2048, 512, True)]


def _layer(k: int, n: int, bias: bool) -> tuple[nn.Linear, Avx512Bf16Linear]:
    torch.manual_seed(k + n)
    lin = nn.Linear(k, n, bias=bias).to(BF16)
    return lin, Avx512Bf16Linear.from_linear(lin)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_row_has_the_same_bits_alone_at_any_position_count_and_thread_count(shape):
    _, kern = _layer(*shape)
    x = torch.randn(300, shape[0]).to(BF16)
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            with torch.inference_mode():
                alone = torch.cat([kern(x[i : i + 1]) for i in range(300)])
                for m in ROWS:  # every row of every count, at its own position
                    assert torch.equal(kern(x[:m]), alone[:m]), f"{m} rows, {t} thread(s)"
                for m in ROWS[1:]:  # row 0 moved to the last position of m rows
                    moved = torch.cat([x[1:m], x[:1]])
                    assert torch.equal(kern(moved)[-1:], alone[:1]), f"last of {m}"
            if t == 1:
                one_thread = alone
            else:
                assert torch.equal(alone, one_thread)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("shape", SHAPES)
def test_it_computes_the_linear(shape):
    lin, kern = _layer(*shape)
    x = torch.randn(40, shape[0]).to(BF16)
    bias = None if lin.bias is None else lin.bias.double()
    with torch.inference_mode():
        ref = F.linear(x.double(), lin.weight.double(), bias)
        got = kern(x.view(4, 10, -1)).view(40, -1).double()  # leading dims kept
    assert got.shape == ref.shape
    # exact bf16 products summed in fp32, one rounding to bf16 (relative error ~2^-9)
    assert torch.allclose(got, ref, rtol=8e-3, atol=8e-3 * ref.abs().max().item())


def _kernel_on_zen4(batch_invariant: bool, settings: KernelSettings | None = None) -> str:
    """The linear the selection picks for bf16 on a CPU with AVX512-BF16 and no AMX."""
    s = settings or KernelSettings()
    return select_kernels(s, BF16, "cpu", batch_invariant, cpu=ZEN4).linear


def test_pack_linears_serves_bf16_on_it_and_keeps_onednn_when_not_invariant():
    torch.manual_seed(0)

    def model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(64, 96).to(BF16), nn.Linear(96, 64).float())

    inv, var = model(), model()
    pack_linears(inv, batch_invariant=True, kernel=_kernel_on_zen4(True))
    pack_linears(var, batch_invariant=False, kernel=_kernel_on_zen4(False))
    assert isinstance(inv[0], Avx512Bf16Linear) and isinstance(inv[1], PackedLinear)
    assert isinstance(var[0], PackedLinear) and isinstance(var[1], PackedLinear)


def test_a_tied_bf16_head_gets_the_kernel(tmp_path):
    from pdserve.model.loader import load_model
    from pdserve.model.tiny import TinySpec, make_tiny

    spec = TinySpec(hidden=256, vocab=1000, tie=True)
    model = load_model(make_tiny(tmp_path / "m", spec), "bfloat16").model
    pack_linears(model, batch_invariant=True, kernel="avx512bf16")
    assert isinstance(model.tied_head, Avx512Bf16Linear)  # rows: test_batch_invariant_ops
    h = torch.randn(8, 256).to(BF16)
    with torch.inference_mode():
        ref = F.linear(h.float(), model.embed_tokens.weight.float())
        assert torch.allclose(model.compute_logits(h), ref, rtol=8e-3, atol=0.05)


def test_the_switch_turns_it_on_and_off():
    """PDSERVE_AVX512_BF16_LINEAR=0 / 1 (on by default): oneDNN, named not invariant / the
    kernel; pack_linears serves what was chosen."""
    for value, served in (("0", PackedLinear), ("1", Avx512Bf16Linear)):
        settings = KernelSettings.from_env({"PDSERVE_AVX512_BF16_LINEAR": value})
        model = nn.Sequential(nn.Linear(64, 96).to(BF16))
        pack_linears(model, batch_invariant=True, kernel=_kernel_on_zen4(True, settings))
        assert isinstance(model[0], served)
    assert _kernel_on_zen4(True, KernelSettings.from_env({})) == "avx512bf16"


def test_bad_input_names_the_problem():
    _, kern = _layer(64, 32, False)
    with pytest.raises(RuntimeError, match="x must be"):
        kern(torch.randn(2, 64))  # fp32
    with pytest.raises(RuntimeError, match="K or n does not match"):
        kern(torch.randn(2, 96).to(BF16))
    assert kern(torch.randn(0, 64).to(BF16)).shape == (0, 32)


def test_weights_packed_back_to_back_are_packed_alike():
    torch.manual_seed(1)
    lins = [nn.Linear(k, n).to(BF16) for k, n in ((100, 37), (512, 768), (33, 4100))]
    together = avx512_bf16_linear.pack_all([lin.weight for lin in lins])
    x = torch.randn(7, 100).to(BF16)
    for lin, packed in zip(lins, together, strict=True):
        assert torch.equal(packed, avx512_bf16_linear.pack(lin.weight))
    with torch.inference_mode():
        one = Avx512Bf16Linear.from_linear(lins[0], together[0])
        assert torch.equal(one(x), Avx512Bf16Linear.from_linear(lins[0])(x))
    assert together[1].data_ptr() == together[0].data_ptr() + 2 * together[0].numel()


# (I, K, bias): I a multiple of 32 or not (a part-filled last panel), K odd / even;
# bench50m's gate_up (I = 2048, K = 512)
GATE_UP_SHAPES = [
    (2048, 512, False),
    (100, 64, True),
    (32, 7, False),
    (48, 130, True),
    (1, 3, True),
]


@pytest.mark.parametrize("shape", GATE_UP_SHAPES)
def test_the_fused_silu_mul_has_the_bits_of_gate_up_then_silu_mul(shape):
    """Avx512Bf16SiluMulLinear = silu_mul(Avx512Bf16Linear(W)(x)) bit for bit, for every row
    count (1-2: the decode blocks, 3-6, and several blocks), so the fused path serves the same
    tokens; and a row's bits alone are its bits in a batch."""
    i, k, bias = shape
    torch.manual_seed(i + k)
    lin = nn.Linear(k, 2 * i, bias=bias).to(BF16)
    plain = Avx512Bf16Linear.from_linear(lin)
    fused = avx512_bf16_linear.Avx512Bf16SiluMulLinear.from_linear(lin)
    require(pointwise.KERNEL)  # the epilogue shares its silu with the pointwise kernel
    ops = pointwise.ops("fused")
    x = (3 * torch.randn(300, k)).to(BF16)  # gate values out to the exp's clamp
    with torch.inference_mode():
        for m in ROWS:
            want = ops.silu_mul(plain(x[:m]))
            got = fused(x[:m])
            assert got.shape == (m, i)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"{m} rows"
        alone = torch.cat([fused(x[r : r + 1]) for r in range(17)])
        assert torch.equal(alone, fused(x[:17]))
        assert fused(x[:4].view(2, 2, k)).shape == (2, 2, i)


def test_gate_up_order_puts_a_columns_gate_and_up_in_one_panel():
    w = torch.arange(2 * 40).float()[:, None].expand(80, 3)  # row r holds r
    out = avx512_bf16_linear.gate_up_order(w)
    assert out.shape == (128, 3)  # 2 panels of 64 rows
    col = out[:, 0].tolist()
    assert col[:32] == list(range(32)) and col[32:64] == list(range(40, 72))  # gate | up
    assert col[64:72] == list(range(32, 40)) and col[96:104] == list(range(72, 80))
    assert col[72:96] == [0.0] * 24 and col[104:] == [0.0] * 24  # past I: zeros


def test_pack_linears_fuses_silu_mul_into_a_llama_gate_up_with_the_same_bits(tmp_path):
    """The served path: pack_linears gives a llama model's gate_up the fused kernel, and the
    model's hidden states are bit-equal to the unfused packing's."""
    from pdserve.model.attention import AttentionMetadata
    from pdserve.model.loader import load_model
    from pdserve.model.tiny import TinySpec, make_tiny

    require(pointwise.KERNEL)
    spec = TinySpec(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=200, vocab=600)
    path = make_tiny(tmp_path / "m", spec)
    fused, plain = (load_model(path, "bfloat16").model for _ in range(2))
    pack_linears(fused, batch_invariant=True, kernel="avx512bf16")
    pack_linears(plain, batch_invariant=True, fuse_silu_mul=False, kernel="avx512bf16")
    for m in (fused, plain):  # the served ops (the epilogue's silu is the kernel's)
        m.pointwise = pointwise.ops("fused")
    for m, silu in ((fused, avx512_bf16_linear.Avx512Bf16SiluMulLinear), (plain, Avx512Bf16Linear)):
        assert all(type(layer.gate_up_proj) is silu for layer in m.layers)
    bs, t = 16, 37
    meta = AttentionMetadata.build([t], [t], [list(range(3))], bs, torch.device("cpu"))
    ids = torch.randint(3, 600, (t,))
    pos = torch.arange(t)
    outs = []
    for m in (fused, plain):
        caches = [torch.zeros(4, 2, bs, 2, 32, dtype=BF16) for _ in m.layers]
        with torch.inference_mode():
            outs.append(m(ids, pos, caches, meta))
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


def test_onednn_bf16_is_batch_variant_on_this_cpu():
    """The reason for the kernel (a probe, not a requirement): the packed oneDNN bf16 linear
    gives some row other bits inside a batch. Skips on a CPU where oneDNN happens not to."""
    torch.manual_seed(0)
    lin = nn.Linear(2048, 512, bias=False).to(BF16)
    packed = PackedLinear(lin)
    x = torch.randn(300, 2048).to(BF16)
    with torch.inference_mode():
        differs = not torch.equal(packed(x), torch.cat([packed(x[i : i + 1]) for i in range(300)]))
    if not differs:
        pytest.skip("oneDNN's bf16 linear is row-invariant at this shape on this CPU")
    kern = Avx512Bf16Linear.from_linear(lin)
    with torch.inference_mode():
        assert torch.equal(kern(x), torch.cat([kern(x[i : i + 1]) for i in range(300)]))
