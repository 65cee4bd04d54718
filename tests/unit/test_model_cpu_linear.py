"""PackedLinear / pack_linears (oneDNN-prepacked CPU weights): same results as F.linear up to
float rounding, every linear of a model packed once, and the packed model's forward equal to
the plain one (fp32: logits within 1e-4, greedy tokens identical)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.model.cpu_linear import PackedLinear, pack_linears, packing_supported
from pdserve.model.loader import load_model

from .model_fixtures import run_paged, tiny_checkpoint

pytestmark = pytest.mark.skipif(
    not packing_supported(torch.float32), reason="oneDNN linear packing unavailable"
)


def _linear(k: int, n: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias).to(dtype).requires_grad_(False)


@pytest.mark.parametrize("rows", [1, 3, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_matches_linear_fp32(rows, bias):
    lin = _linear(96, 80, bias, torch.float32)
    x = torch.randn(rows, 96)
    with torch.inference_mode():
        torch.testing.assert_close(PackedLinear(lin)(x), lin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not packing_supported(torch.bfloat16), reason="no native bf16 on this CPU")
@pytest.mark.parametrize("rows", [1, 8, 130])
def test_packed_matches_linear_bf16(rows):
    lin = _linear(128, 64, True, torch.bfloat16)
    x = torch.randn(rows, 128).to(torch.bfloat16)
    # exact reference: the same bf16 inputs multiplied in fp32; both sides then round to bf16
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    with torch.inference_mode():
        out = PackedLinear(lin)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=1e-2)  # ~1-2 bf16 ulps


def test_packed_takes_3d_and_strided_inputs():
    lin = _linear(32, 16, True, torch.float32)
    x = torch.randn(4, 32, 5).transpose(1, 2)  # [4, 5, 32], not contiguous
    with torch.inference_mode():
        out = PackedLinear(lin)(x)
    assert out.shape == (4, 5, 16)
    torch.testing.assert_close(out, lin(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_pack_model_once_and_same_tokens(tmp_path, tie):
    model_dir = tiny_checkpoint(tmp_path / "m", family="qwen2", vocab=512, tie=tie)
    plain = load_model(model_dir, dtype="float32")
    packed = load_model(model_dir, dtype="float32")
    n = pack_linears(packed.model)
    layers = plain.config.num_layers
    assert n == 4 * layers + (0 if tie else 1)  # qkv, o, gate_up, down (+ untied lm_head)
    assert pack_linears(packed.model) == 0  # idempotent
    assert not any(type(m) is nn.Linear for m in packed.model.modules())
    prompts = [[5, 6, 7], list(range(20, 70))]
    a = run_paged(plain, prompts, 12)
    b = run_paged(packed, prompts, 12)
    for x, y in zip(a, b, strict=True):
        assert x.tokens == y.tokens
        torch.testing.assert_close(torch.stack(x.logits), torch.stack(y.logits), atol=1e-4, rtol=0)


def test_unsupported_dtype_left_alone():
    model = nn.Sequential(_linear(8, 8, False, torch.float64))
    assert pack_linears(model) == 0
    assert type(model[0]) is nn.Linear


def test_auto_dtype_follows_native_bf16(monkeypatch):
    from pdserve.model import cpu_linear
    from pdserve.model.loader import auto_dtype

    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda: False)
    assert auto_dtype("cpu") == torch.float32  # emulated bf16 is slower than fp32
    monkeypatch.setattr(cpu_linear, "cpu_has_native_bf16", lambda: True)
    want = torch.bfloat16 if packing_supported(torch.bfloat16) else torch.float32
    assert auto_dtype("cpu") == want
