"""The kvstore as a real process on 127.0.0.1, driven by KVStoreClient over gRPC + UCX."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest

from pdserve.kv.hashing import block_hashes
from pdserve.kv.store_client import KVStoreClient, block_checksums
from pdserve.kv.transfer import UcxTransport
from pdserve.rpc.ready import parse_ready_line
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")

BPB = 16 * 1024  # bytes per block
CAPACITY = 64 * BPB  # 1 MiB
STAGING = 32 * BPB
NS = "model-a|kv"


@dataclass
class Store:
    proc: subprocess.Popen
    addr: str

    def rss_bytes(self) -> int:
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def start_store(*extra: str) -> Store:
    argv = [sys.executable, "-m", "pdserve.kvstore", "--port", "0", "--log-format", "console"]
    argv += ["--capacity-bytes", str(CAPACITY), "--staging-bytes", str(STAGING), *extra]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=None if os.environ.get("KV_DEBUG") else subprocess.DEVNULL, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    deadline = time.monotonic() + 60
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        info = parse_ready_line(line)
        if info is not None:
            return Store(proc, f"127.0.0.1:{info['port']}")
    proc.kill()
    raise RuntimeError("kvstore did not print PDSERVE_READY")


def stop_store(store: Store) -> None:
    if store.proc.poll() is None:
        store.proc.send_signal(signal.SIGTERM)
        try:
            store.proc.wait(15)
        except subprocess.TimeoutExpired:
            store.proc.kill()
            store.proc.wait(5)


@pytest.fixture(scope="module")
def store() -> Iterator[Store]:
    s = start_store()
    yield s
    stop_store(s)


@pytest.fixture
async def client(store: Store) -> AsyncIterator[KVStoreClient]:
    transport = await UcxTransport.create()
    c = KVStoreClient(store.addr, transport, raise_errors=True)
    await c.clear()
    yield c
    await c.close()
    await transport.close()


def chain(seed: int, n: int, ns: str = NS) -> list[bytes]:
    return block_hashes([seed * 7919 + i for i in range(16 * n)], 16, ns)


def blocks(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=n * BPB, dtype=np.uint8)


async def test_put_lookup_fetch_roundtrip(client: KVStoreClient) -> None:
    h, data = chain(1, 6), blocks(1, 6)
    assert await client.put(NS, h[:4], 0, data[: 4 * BPB]) == 4
    assert await client.put(NS, h, 2, data[2 * BPB :]) == 2  # the store wants blocks 4..5 only
    assert await client.lookup(NS, h) == 6
    assert await client.lookup("other-model", h) == 0  # namespaces never share blocks
    out = np.zeros(8 * BPB, np.uint8)
    assert await client.fetch(NS, [*h, *chain(2, 2)], out) == 6
    np.testing.assert_array_equal(out[: 6 * BPB], data)
    stats = await client.stats()
    assert stats is not None and stats.num_blocks == 6 and stats.bytes_out == 6 * BPB


async def test_fetch_into_bfloat16_tensor(client: KVStoreClient) -> None:
    torch = pytest.importorskip("torch")
    h = chain(3, 2)
    src = torch.randn(2, 2, BPB // 4, dtype=torch.bfloat16)  # 2 blocks of BPB bytes
    assert await client.put(NS, h, 0, src) == 2
    dst = torch.zeros_like(src)
    assert await client.fetch(NS, h, dst) == 2
    assert torch.equal(src, dst)


async def test_corrupt_put_is_dropped(client: KVStoreClient, store: Store) -> None:
    h, data = chain(4, 2), blocks(4, 2)
    stub = kvstore_pb2_grpc.KVStoreStub(client._channel)
    begin = await stub.BeginPut(
        kvstore_pb2.BeginPutRequest(namespace=NS, block_hashes=h, bytes_per_block=BPB)
    )
    assert begin.num_accepted == 2
    wrong = data.copy()
    wrong[BPB + 3] ^= 1  # checksums of `data`, bytes of `wrong`
    await client.transport.send(begin.ucx_worker_address, begin.tag, wrong, timeout_s=5)
    sums = block_checksums(data, BPB, 2)
    done = await stub.CommitPut(kvstore_pb2.CommitPutRequest(put_id=begin.put_id, checksums=sums))
    assert done.num_stored == 0
    stats = await client.stats()
    assert stats is not None and stats.corrupt_puts >= 1 and stats.used_bytes == 0
    assert await client.lookup(NS, h) == 0


async def test_eviction_under_small_capacity_and_rss(client: KVStoreClient, store: Store) -> None:
    rss_before = store.rss_bytes()
    n_chains, per_chain = 6, 16  # 96 blocks offered into room for 64
    for seed in range(n_chains):
        assert await client.put(NS, chain(100 + seed, per_chain), 0, blocks(seed, per_chain)) > 0
        stats = await client.stats()
        assert stats is not None and stats.used_bytes <= stats.capacity_bytes == CAPACITY
    assert stats.evictions >= n_chains * per_chain - CAPACITY // BPB
    last = chain(100 + n_chains - 1, per_chain)
    out = np.zeros(per_chain * BPB, np.uint8)
    assert await client.fetch(NS, last, out) == per_chain  # the newest chain survived whole
    np.testing.assert_array_equal(out, blocks(n_chains - 1, per_chain))
    # oldest chains lost their tails first: whatever is left of chain 0 is a prefix
    assert await client.lookup(NS, chain(100, per_chain)) < per_chain
    # RSS grows by at most the arena + the staging budget (+ 16 MiB allocator/grpc slack)
    assert store.rss_bytes() - rss_before <= CAPACITY + STAGING + (16 << 20)


async def test_uncommitted_put_expires_then_store_killed() -> None:
    s = start_store("--put-timeout-s", "0.5")
    transport = await UcxTransport.create()
    c = KVStoreClient(s.addr, transport, rpc_timeout_s=1.0, transfer_timeout_s=2.0)
    try:
        h, data = chain(5, 4), blocks(5, 4)
        assert await c.put(NS, h, 0, data) == 4
        out = np.zeros(4 * BPB, np.uint8)
        assert await c.fetch(NS, h, out) == 4
        # a put whose bytes and commit never come is dropped and its slots freed
        stub = kvstore_pb2_grpc.KVStoreStub(c._channel)
        h2 = chain(6, 2)
        req = kvstore_pb2.BeginPutRequest(namespace=NS, block_hashes=h2, bytes_per_block=BPB)
        begin = await stub.BeginPut(req)
        assert begin.num_accepted == 2
        stats = await c.stats()
        assert stats is not None and stats.used_bytes == 6 * BPB
        for _ in range(100):  # the reaper runs every put_timeout_s / 4
            await asyncio.sleep(0.1)
            stats = await c.stats()
            if stats is not None and stats.used_bytes == 4 * BPB:
                break
        assert stats is not None and stats.used_bytes == 4 * BPB
        commit = kvstore_pb2.CommitPutRequest(put_id=begin.put_id)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.CommitPut(commit)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        # kill -9 the store
        s.proc.send_signal(signal.SIGKILL)
        s.proc.wait(10)
        # a hang guard, not a timing assertion: each call must give up on its own
        assert await asyncio.wait_for(c.fetch(NS, h, out), 30) == 0
        assert await asyncio.wait_for(c.lookup(NS, h), 30) == 0
        assert await asyncio.wait_for(c.put(NS, h, 0, data), 30) == 0
        assert c.failures >= 1 and not c.available  # backing off: later calls skip the store
    finally:
        await c.close()
        await transport.close()
        stop_store(s)
