"""`bench multiturn --trace T --store-replay N`: the KV traffic of a Mooncake trace against a
real kvstore process (gRPC + UCX, real block files), without the model: per request, look
the chain up, fetch the stored prefix, put the blocks it lacks. One arm per capacity (RAM or
RAM+DISK), each on a fresh store. Measures the fetch latency by tier (a fetch is "disk" when
its lookup found at least one block on disk only: the store's `disk_hits` counter, read
around the lookup) and checks every fetched byte against what was put (never wrong KV).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.bench.cachesim import block_key, full_blocks, parse_tiers
from pdserve.kv.store_client import KVStoreClient
from pdserve.kv.transfer import UcxTransport
from pdserve.rpc.ready import parse_ready_line
from pdserve.workload.traces import MOONCAKE_BLOCK_TOKENS, TraceRecord

NS = "store-replay"


def block_bytes_of(hash_id: int, nbytes: int) -> np.ndarray:
    """Deterministic bytes of one block (from its hash id)."""
    return np.random.default_rng(hash_id).integers(0, 256, nbytes, dtype=np.uint8)


def start_store(ram: int, disk: int, disk_dir: str, staging: int) -> tuple[subprocess.Popen, str]:
    argv = [sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--log-format", "console",
            "--insecure",
            "--capacity-bytes", str(ram), "--staging-bytes", str(staging)]  # fmt: skip
    if disk:
        argv += ["--disk-dir", disk_dir, "--disk-bytes", str(disk)]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        info = parse_ready_line(line)
        if info is not None:
            return proc, f"127.0.0.1:{info['port']}"
    proc.kill()
    raise RuntimeError("kvstore did not start")


def _pct(xs: list[tuple[float, int]]) -> dict[str, float | int | None]:
    """Per-fetch latency percentiles and the mean time per MiB fetched (fetch sizes differ
    between tiers: later turns fetch longer prefixes)."""
    if not xs:
        return {"n": 0, "p50_ms": None, "p90_ms": None, "mean_ms": None, "ms_per_MiB": None}
    a = np.array([t for t, _ in xs]) * 1e3
    mib = sum(n for _, n in xs) / 2**20
    return {"n": len(xs), "p50_ms": float(np.percentile(a, 50)),
            "p90_ms": float(np.percentile(a, 90)), "mean_ms": float(a.mean()),
            "ms_per_MiB": float(a.sum() / mib)}  # fmt: skip


async def drive(addr: str, records: Sequence[TraceRecord], bpb: int) -> dict[str, Any]:
    transport = await UcxTransport.create()
    client = KVStoreClient(addr, transport, rpc_timeout_s=30, transfer_timeout_s=60,
                           raise_errors=True)  # fmt: skip
    lat: dict[str, list[tuple[float, int]]] = {"ram": [], "disk": []}
    prompt = hit = wrong = 0
    try:
        for rec in records:
            ids = full_blocks(rec)
            prompt += rec.input_len
            if not ids:
                continue
            chain = [block_key(h) for h in ids]
            before = (await client.stats()).disk_hits
            n = await client.lookup(NS, chain)
            tier = "disk" if (await client.stats()).disk_hits > before else "ram"
            got = 0
            if n:
                out = np.empty(n * bpb, np.uint8)
                t0 = time.perf_counter()
                got = await client.fetch(NS, chain[:n], out)
                lat[tier].append((time.perf_counter() - t0, n * bpb))
                for i in range(got):
                    if not np.array_equal(
                        out[i * bpb : (i + 1) * bpb], block_bytes_of(ids[i], bpb)
                    ):
                        wrong += 1
            hit += got * MOONCAKE_BLOCK_TOKENS
            if got < len(ids):
                data = np.concatenate([block_bytes_of(h, bpb) for h in ids[got:]])
                await client.put(NS, chain, got, data)
        stats = await client.stats()
    finally:
        await client.close()
        await transport.close()
    return {
        "hit_rate": hit / prompt if prompt else 0.0,
        "fetch_latency": {k: _pct(v) for k, v in lat.items()},
        "wrong_blocks": wrong,
        "stats": {f.name: getattr(stats, f.name) for f, _ in stats.ListFields()},
    }


def store_replay(records: Sequence[TraceRecord], specs: Sequence[str], bpb: int) -> dict[str, Any]:
    arms: dict[str, Any] = {}
    for spec in specs:
        ram, disk = parse_tiers(spec)
        if ram is None:
            raise ValueError("--store-replay needs finite capacities")
        with tempfile.TemporaryDirectory(prefix="pdserve-disk-") as d:
            proc, addr = start_store(ram, disk, d, max(256 << 20, 64 * bpb))
            try:
                arms[spec] = asyncio.run(drive(addr, records, bpb))
            finally:
                proc.terminate()
                proc.wait(30)
        r = arms[spec]
        f = r["fetch_latency"]
        print(f"{spec:>14}: hit rate {r['hit_rate']:.1%}, fetch p50 RAM "
              f"{f['ram']['p50_ms'] or 0:.1f} ms ({f['ram']['ms_per_MiB'] or 0:.1f} ms/MiB, "
              f"n={f['ram']['n']}), disk {f['disk']['p50_ms'] or 0:.1f} ms "
              f"({f['disk']['ms_per_MiB'] or 0:.1f} ms/MiB, n={f['disk']['n']}), wrong blocks "
              f"{r['wrong_blocks']}", flush=True)  # fmt: skip
    return {"mode": "store_replay", "block_bytes": bpb, "arms": arms}
