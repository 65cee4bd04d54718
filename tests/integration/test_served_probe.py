"""`sim validate --probe` on a real arm: the served probe on the arm's idle cluster, and the
window over its benchmark (the machine's CPUs, each worker's engine steps read over the
cluster's mutual TLS)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.bench.cluster import UpProcess
from pdserve.bench.step_log import overlap_shares, prefill_and_others, read_step_logs
from pdserve.client import AsyncClient
from pdserve.sim.served_probe import served_probe
from pdserve.sim.validate import ArmWindow

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")


async def _requests(addr: str, n: int) -> None:
    async with AsyncClient(addr, timeout=60.0) as client:
        for i in range(n):
            await client.generate(token_ids=[20 + i + k for k in range(24)], max_tokens=6,
                                  ignore_eos=True)  # fmt: skip


def test_the_served_probe_and_the_arm_window_on_a_served_1p1d(tmp_path):
    up = UpProcess(["--mode", "disagg", "--prefill", "1", "--decode", "1",
                    f"--worker-arg=--step-log={tmp_path / 'steps'}"], port=0,
                   ready_timeout_s=180.0, log_path=tmp_path / "up.log")  # fmt: skip
    with up as addr:
        probe = asyncio.run(served_probe(addr, repeats=3, prompt_len=16, max_tokens=8))
        window = ArmWindow.open(addr, up.tls_dir)
        asyncio.run(_requests(addr, 4))
        got = window.close()
    assert probe["repeats"] == 3 and probe["ttft_s"] > 0 and probe["tpot_s"] > 0
    assert got["wall_s"] > 0
    assert got["cpu"] is not None and 0 <= got["cpu"]["steal"] <= 1
    assert got["cpu"]["busy"] + got["cpu"]["steal"] + got["cpu"]["idle"] == pytest.approx(1.0)
    engines = got["engines"]
    assert sorted(e["role"] for e in engines.values()) == ["decode", "prefill"]  # over TLS
    # the prefill computed 4 prompts (at least a step each), the decode 5 tokens of each
    assert sorted(e["steps"] for e in engines.values())[0] >= 4
    assert max(e["steps"] for e in engines.values()) >= 5
    assert all(e["step_seconds"] > 0 and e["mean_step_s"] > 0 for e in engines.values())

    # every step of both workers in their step logs, on one clock: the prefill is the worker
    # that pushed (the probe's 3 prompts and the 4 requests, and the warm-up's)
    prefill, decode = prefill_and_others(read_step_logs(tmp_path / "steps"))
    assert sum(s.pushes for s in prefill) >= 7 and all(s.chunks == 1 for s in prefill)
    assert len(decode) >= 4 * 5 and all(s.tokens == s.seqs for s in decode)
    shares = overlap_shares(prefill, decode)
    assert len(shares) == len(prefill) and all(0.0 <= x <= 1.0 + 1e-9 for x in shares)
