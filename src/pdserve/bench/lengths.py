"""The length workload: real prompts with the output length a chosen model really
produced (the length data, `pdserve predictor` format), for measuring scheduling that
predicts output lengths.

Each request sends the prompt as text (the router's predictor reads it), with
max_tokens = that model's answer length x `scale` (the tiny CPU model cannot afford
real lengths; say the scale with every result) and ignore_eos, and carries the same
number as `oracle_tokens` (metadata that only a router started with
--predictor-oracle reads). Also: the cluster's preemption count after an arm."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

from pdserve.bench.workload import BenchRequest


def length_requests(
    path: str,
    model: str,
    n: int,
    *,
    split: str = "val",
    scale: float = 0.05,
    seed: int = 0,
    max_prompt_chars: int = 1500,
    max_output: int | None = None,
) -> list[BenchRequest]:
    """`n` (prompt, length) pairs of `model` (its `model_canonical`; "any" = every
    model) from rows of `split` ("" = all), drawn without replacement with `seed`."""
    from pdserve.router.scheduling.predictor.evaluate import read_rows

    rows = [
        r
        for r in read_rows(path)
        if (model == "any" or r.get("model_canonical") == model)
        and (not split or r.get("prompt_split") == split)
        and r.get("prompt")
    ]
    if not rows:
        raise ValueError(f"no rows of model {model!r} (split {split!r}) in {path}")
    rows.sort(key=lambda r: str(r.get("id", "")))
    rng = np.random.default_rng([seed, 5])
    picks = rng.permutation(len(rows))[: min(n, len(rows))]
    reqs = []
    for i, j in enumerate(picks):
        r = rows[int(j)]
        n_out = max(1, round(int(r["response_tokens_cl100k"]) * scale))
        if max_output:
            n_out = min(n_out, max_output)
        text = str(r["prompt"])[:max_prompt_chars]
        reqs.append(BenchRequest(i, [], n_out, prompt_text=text, oracle_tokens=n_out))
    return reqs


async def worker_counters(
    addr: str, timeout: float = 5.0, tls_dir: str | None = None
) -> tuple[Any, dict[str, dict[str, float]]]:
    """The router's Status and every worker's Info counters, by instance id. `tls_dir`: the
    cluster's certificates (the admin one is used), else a plaintext channel (--insecure)."""
    import grpc

    from pdserve.client import AsyncClient
    from pdserve.v1 import worker_pb2, worker_pb2_grpc

    async with AsyncClient(addr) as client:
        status = await client.status(timeout=timeout)
    out: dict[str, dict[str, float]] = {}
    for inst in status.instances:
        if tls_dir:
            from pdserve.rpc.tls import TlsFiles, secure_channel

            channel = secure_channel(inst.address, TlsFiles.in_dir(tls_dir, "admin"))
        else:
            channel = grpc.aio.insecure_channel(inst.address)
        try:
            async with channel:
                info = await worker_pb2_grpc.WorkerStub(channel).Info(
                    worker_pb2.InfoRequest(), timeout=timeout
                )
        except grpc.RpcError:
            continue
        out[inst.instance_id] = dict(info.counters)
    return status, out


async def _preemptions(
    addr: str, timeout: float = 5.0, tls_dir: str | None = None
) -> dict[str, float]:
    status, counters = await worker_counters(addr, timeout, tls_dir)
    out: dict[str, float] = {
        "_predictor_kendall_tau": status.predictor_kendall_tau,
        "_predictor_observed": float(status.predictor_observed),
    }
    for name, c in counters.items():
        out[name] = float(c.get("engine_num_preemptions", 0.0))
    return out


def cluster_preemptions(addr: str, tls_dir: str | None = None) -> dict[str, Any]:
    """Preemptions per worker and in total (from each worker's Info counters), and the
    router's running Kendall tau of its length predictions (Status). `tls_dir`: the
    cluster's certificates (a default mutual-TLS cluster refuses plaintext calls)."""
    per = asyncio.run(_preemptions(addr, tls_dir=tls_dir))
    router = {k.lstrip("_"): per.pop(k) for k in list(per) if k.startswith("_")}
    return {"total": sum(per.values()), "per_instance": per, "router": router}


def wait_vs(records: list, base_records: list, factor: float = 2.0) -> dict[str, Any]:
    """Per request (matched by index), TTFT in this arm over TTFT in the base arm: how
    many waited more than `factor` x their base-arm time to first token, and the worst."""
    base = {r.index: r.ttft_s for r in base_records if r.ttft_s}
    ratios = [r.ttft_s / base[r.index] for r in records if r.ttft_s and r.index in base]
    if not ratios:
        return {"n": 0}
    arr = np.asarray(ratios)
    return {
        "n": len(ratios),
        f"over_{factor:g}x": int((arr > factor).sum()),
        "max_ratio": round(float(arr.max()), 3),
        "p99_ratio": round(float(np.percentile(arr, 99)), 3),
    }
