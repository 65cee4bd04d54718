"""Roofline hardware, model shapes from config.json, and the planner's arithmetic."""

from __future__ import annotations

import json

import pytest

from pdserve.costmodel.hardware import ACCELERATORS
from pdserve.costmodel.roofline import RooflineStep, pool_costs, roofline_costs
from pdserve.costmodel.shapes import load_model_config
from pdserve.sim.candidates import Budget, candidates
from pdserve.sim.plan import cost_per_m_tokens


@pytest.mark.parametrize(
    "name,params_b,kv_per_token",
    [
        ("llama3-8b", 8.03, 131072),
        ("llama3-70b", 70.55, 327680),
        ("qwen2.5-32b", 32.76, 262144),
        # OPT: two-matrix MLP (fc1, fc2), biases, tied lm_head; published 12.85 B and 65.7 B
        ("opt-13b", 12.85, 819200),
        ("opt-66b", 65.7, 2359296),
    ],
)
def test_builtin_shapes_match_published_sizes(name, params_b, kv_per_token):
    m = load_model_config(name)
    assert m.params / 1e9 == pytest.approx(params_b, rel=0.005)
    assert m.kv_bytes_per_token(2) == kv_per_token  # 2 x layers x kv heads x head dim x 2 B


def test_config_json_from_a_path(tmp_path):
    cfg = {"hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
           "num_key_value_heads": 2, "intermediate_size": 2048, "vocab_size": 16384,
           "max_position_embeddings": 4096}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = load_model_config(str(tmp_path))
    assert m.head_dim == 64 and m.kv_bytes_per_token(4) == 2 * 8 * 2 * 64 * 4
    with pytest.raises(ValueError):
        load_model_config(str(tmp_path / "missing"))


def test_roofline_decode_is_memory_bound_prefill_compute_bound():
    m = load_model_config("llama3-8b")
    hw = ACCELERATORS["h100"]
    peak, bw = hw.bf16_tflops * 1e12, hw.mem_bw_TBps * 1e12
    st = RooflineStep(m, hw, 2, 1, compute_eff=0.5, memory_eff=0.8, step_overhead_s=0.0,
                      attn_compute_eff=0.4, attn_memory_eff=0.7)  # fmt: skip
    weights_s = m.matmul_params * 2 / (bw * 0.8)  # every weight once, lm_head included
    assert st.step_s([(0, 1)]) == pytest.approx(weights_s, rel=1e-3)
    # prefill: the layers' matmuls per token, the lm_head once per sequence, attention apart
    layers = m.matmul_params - m.head_params
    dense_s = 2 * (layers * 4096 + m.head_params) / (peak * 0.5)
    attn_s = 4 * m.num_layers * m.num_heads * m.head_dim * (4096 * 4097 / 2) / (peak * 0.4)
    assert st.step_s([(0, 4096)]) == pytest.approx(dense_s + attn_s, rel=1e-9)
    # a mixed step: compute-bound matmuls and memory-bound KV reads add, neither hides the other
    mixed = [(0, 2048)] + [(4096, 1)] * 64
    kv_s = (2048 + 64 * 4097) * m.kv_bytes_per_token(2) / (bw * 0.7)
    assert st.step_s(mixed) > st.step_s([(0, 2048)]) + 0.9 * kv_s


def test_kv_capacity_and_tensor_parallel():
    c = roofline_costs("llama3-8b", "h100")
    assert 50e9 < c.kv_capacity_bytes < 57e9  # 72 GB usable - 16 GB of weights
    with pytest.raises(ValueError):
        roofline_costs("llama3-70b", "h100")  # 141 GB of weights on 80 GB
    tp2 = roofline_costs("llama3-70b", "h100x2")
    assert tp2.devices == 2 and tp2.kv_capacity_bytes > 0


def test_kv_dtype_apart_from_the_weights():
    bf = roofline_costs("llama3-8b", "h100")
    fp8 = roofline_costs("llama3-8b", "h100", kv_dtype="fp8")
    assert bf.kv_bytes_per_token == 131072  # 2 x 32 layers x 8 kv heads x 128 x 2 B
    # fp8 elements + a float32 scale per 16-token block, K/V and kv head: 0.504x the bytes
    assert fp8.kv_bytes_per_token == 65536 + 2 * 32 * 8 * 4 // 16
    assert fp8.kv_capacity_bytes == bf.kv_capacity_bytes  # the weights did not change
    assert fp8.step.step_s([(0, 1)]) == pytest.approx(bf.step.step_s([(0, 1)]), rel=1e-4)
    long_decode = [(8192, 1)] * 64  # memory-bound: reading KV dominates
    assert fp8.step.step_s(long_decode) < 0.7 * bf.step.step_s(long_decode)
    assert fp8.name.endswith("/kv=fp8")


def test_heterogeneous_pools():
    pc = pool_costs("llama3-8b", "h100,l40s", "pcie4")
    assert pc["prefill"].name.endswith("h100/bfloat16") and pc["decode"].name.endswith(
        "l40s/bfloat16"
    )
    decode_batch = [(1024, 1)] * 32
    assert pc["decode"].step.step_s(decode_batch) > pc["prefill"].step.step_s(decode_batch)


def test_budget_and_candidates():
    b = Budget.parse("h100:16", "h100=2.5")
    assert b.devices == {"h100": 16} and b.prices == {"h100": 2.5}
    with pytest.raises(ValueError):
        Budget.parse("h100")
    cands = candidates(b, "llama3-8b", "nvlink", "bfloat16", [2048], [256], max_unit=4)
    labels = [c.label for c in cands]
    # colocated x1; coprime units with M + N <= 4: 1:1, 1:2, 2:1, 1:3, 3:1
    assert len(cands) == 6 and sum(lbl.startswith("disagg") for lbl in labels) == 5
    two_one = next(c for c in cands if c.kind == "disagg" and c.n_prefill == 2 and c.n_decode == 1)
    assert two_one.num_devices == 3
    spec = two_one.spec(replicas=5, max_model_len=8192)
    assert [(p.role, p.count) for p in spec.pools] == [("prefill", 10), ("decode", 5)]


def test_cost_per_million_output_tokens():
    # 16 devices at $2/h = $32/h; 10 req/s x 100 tokens = 3.6 M tokens/h -> $8.89 per M
    assert cost_per_m_tokens({"h100": 16}, {"h100": 2.0}, 10.0, 100.0) == pytest.approx(32 / 3.6)
    assert cost_per_m_tokens({"h100": 16}, {}, 10.0, 100.0) is None


def test_tensor_parallel_budget_counts_devices():
    b = Budget.parse("a100x2:8")
    assert b.devices == {"a100": 8} and b.instance_specs() == ["a100x2"]
    cands = candidates(b, "opt-66b", "nvlink3", "float16", [2048], [128], max_unit=4)
    one_one = next(c for c in cands if c.kind == "disagg" and (c.n_prefill, c.n_decode) == (1, 1))
    assert one_one.devices() == {"a100": 4}  # 2 instances x TP 2
    assert not any(c.kind == "disagg" and c.num_devices > 8 for c in cands)


def test_heterogeneous_search_pairs_each_pool_with_each_type():
    b = Budget.parse("h100:4,l40s:4")
    cands = candidates(b, "llama3-8b", "pcie4", "bfloat16", [2048], [128], max_unit=2)
    pairs = {(c.hw_prefill, c.hw_decode) for c in cands if c.kind == "disagg"}
    assert pairs == {("h100", "h100"), ("h100", "l40s"), ("l40s", "h100"), ("l40s", "l40s")}
    mixed = next(c for c in cands if (c.hw_prefill, c.hw_decode) == ("h100", "l40s"))
    assert mixed.devices() == {"h100": 1, "l40s": 1}
    assert "h100/l40s" in mixed.label
    spec = mixed.spec(replicas=2, max_model_len=4096)
    assert [(p.role, p.count, p.costs.name.split("@")[1]) for p in spec.pools] == [
        ("prefill", 2, "h100/bfloat16"), ("decode", 2, "l40s/bfloat16")
    ]  # fmt: skip
