"""Quantized KV end to end on real processes: a 1 prefill + 1 decode cluster whose workers run
`--kv-dtype int8` pushes exactly the quantized bytes (elements + scales: <= 0.51x bf16) over
UCX, and its greedy tokens equal the in-process engine's with the same KV dtype."""

from __future__ import annotations

import pytest

from pdserve.client import Client
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.params import SamplingParams
from pdserve.kv.spec import KVSpec
from pdserve.launcher import Cluster, ClusterConfig
from pdserve.worker.nonce import TOKEN_MESSAGE_INT32

from .conftest import pool_idle, wait_until
from .test_worker_metrics import _free_port, _scrape

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("kind", ["int8", "fp8_e4m3"])
def test_quantized_kv_disaggregated(serving_model_dir, tmp_path, kind):
    prompt, max_tokens = list(range(1, 41)), 6  # 40 tokens: 3 blocks of 16
    ref = LLMEngine(
        EngineConfig(
            model_dir=str(serving_model_dir), dtype="float32", num_blocks=64, kv_dtype=kind
        )
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = ref.generate([prompt], params)[0]
    spec = ref.spec
    port = _free_port()
    args = ["--num-blocks", "128", "--kv-dtype", kind]
    config = ClusterConfig(model=str(serving_model_dir), port=0, prefill=1, decode=1,
                           log_dir=str(tmp_path), worker_args=args)  # fmt: skip
    with Cluster(config) as cluster:
        cluster.config.worker_args = [*args, "--metrics-port", str(port)]
        cluster.restart("decode0")
        before = _scrape(port)
        result = Client(cluster.addr).generate(
            token_ids=prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        )
        wait_until(lambda: pool_idle(cluster, "decode0"), 15, "decode idle")
        after = _scrape(port)
    assert result.token_ids == expected
    received = "pdserve_worker_ucx_bytes_received_total"
    got = after[received] - before.get(received, 0.0)
    assert got == 3 * spec.bytes_per_block + 4 * TOKEN_MESSAGE_INT32
    bf16 = KVSpec(spec.num_layers, spec.num_kv_heads, spec.head_dim, 16, "bfloat16")
    assert 3 * spec.bytes_per_block <= 0.51 * 3 * bf16.bytes_per_block
