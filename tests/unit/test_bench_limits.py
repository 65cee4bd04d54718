"""pdserve.bench.limits: byte/FLOP counts checked by hand on a small shape; the measurements
return sane positive numbers (no timing assertions)."""

import pytest
import torch

from pdserve.bench import limits as lim
from pdserve.model.config import ModelConfig


def _config(**kw) -> ModelConfig:
    base = dict(
        architecture="LlamaForCausalLM",
        vocab_size=100,
        hidden_size=8,
        intermediate_size=16,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=False,
        sliding_window=None,
        bos_token_id=0,
        eos_token_ids=[1],
        torch_dtype="float32",
    )
    base |= kw
    return ModelConfig(**base)


def test_model_cost_by_hand():
    c = _config()
    cost = lim.ModelCost.of(c, "bfloat16")
    # per layer: qkv 8 x (8 + 2*4) + o 8 x 8 + gate/up/down 3 x 8 x 16 = 128 + 64 + 384
    assert cost.layer_params == 2 * 576
    assert cost.lm_head_params == 800
    assert cost.norm_params == 2 * 16 + 8
    assert cost.itemsize == 2
    assert cost.kv_bytes_per_token == 2 * 2 * 4 * 2  # layers * (K,V) * kv width * bytes
    assert cost.weight_bytes == (1152 + 800 + 40) * 2
    assert lim.ModelCost.of(c, "float32").weight_bytes == 2 * cost.weight_bytes


def test_bias_and_qk_norm_counted():
    plain = lim.ModelCost.of(_config(), "float32")
    qwen = lim.ModelCost.of(_config(attention_bias=True, qk_norm=True), "float32")
    assert qwen.layer_params - plain.layer_params == 2 * 16  # q/k/v bias per layer
    assert qwen.norm_params - plain.norm_params == 2 * 2 * 2  # q_norm + k_norm per layer


def test_decode_bytes_and_prefill_flops_by_hand():
    cost = lim.ModelCost.of(_config(), "float32")
    assert lim.decode_step_bytes(cost, [3, 5]) == cost.weight_bytes + 16 * 4 * 8
    # two steps of 2 sequences after a 4-token prompt: contexts 5 then 6
    assert lim.decode_phase_bytes(cost, 2, 4, 2) == (
        2 * cost.weight_bytes + cost.kv_bytes_per_token * (2 * 5 + 2 * 6)
    )
    # one 3-token prompt: linears 2*1152*3; attention keys seen 1+2+3 = 6,
    # 4 FLOPs * 2 layers * 4 heads * 2 dims * 6; lm_head for one row 2*800
    assert lim.prefill_flops(cost, [3]) == 2 * 1152 * 3 + 4 * 2 * 4 * 2 * 6 + 2 * 800
    # a 2-token chunk after 5 cached tokens sees 6 + 7 keys
    chunk = lim.prefill_flops(cost, [2], cached_lens=[5], sampled=0)
    assert chunk == 2 * 1152 * 2 + 4 * 2 * 4 * 2 * 13


def test_achieved_fraction():
    limits = {"gemm_flops_s": 200.0, "bandwidth_bytes_s": 50.0}
    frac = lim.achieved_fraction(limits, prefill_flops_s=150.0, decode_bytes_s=10.0)
    assert frac == {"prefill": 0.75, "decode": 0.2}
    assert lim.achieved_fraction(limits, decode_bytes_s=25.0) == {"decode": 0.5}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_measure_limits_small(dtype):
    before = torch.get_num_threads()
    out = lim.measure_limits(
        dtype, threads=1, repeats=1, bandwidth_bytes=4 << 20, gemm_shapes=((64, 64, 64),)
    )
    assert torch.get_num_threads() == before  # restored
    assert out["dtype"] == dtype and out["threads"] == 1
    assert out["bandwidth_bytes_s"] > 0 and out["gemm_flops_s"] > 0
    assert out["gemm_flops_s"] == out["detail"]["gemm"]["best"]
    assert "linear_64x64x64" in out["detail"]["gemm"]
    assert f"limits ({dtype}, 1 thread(s))" in lim.format_limits(out)


def test_decode_flops_and_roofline():
    cost = lim.ModelCost.of(_config(), "float32")
    # one step, one sequence after a 4-token prompt: context 5
    want = 2.0 * (1152 + 800) + 4 * 2 * 4 * 2 * 5
    assert lim.decode_phase_flops(cost, 1, 4, 1) == want
    limits = {"gemm_flops_s": 100.0, "bandwidth_bytes_s": 10.0}
    frac = lim.achieved_fraction(limits, decode_bytes_s=2.0, decode_flops_s=60.0)
    assert frac == {"decode": 0.2, "decode_roofline": 0.6}
