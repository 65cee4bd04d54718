"""After a length-workload arm (pdserve.workload.lengths): the cluster's preemptions and the
router's running Kendall tau (from Status and every worker's Info counters), and how much
longer the short requests waited than in the baseline arm."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np


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
