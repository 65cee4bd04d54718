"""KVStoreClient: what workers use to talk to the kvstore. Torch-free (buffers may be tensors).

"A cache, never a dependency": every call has a short deadline, and any failure (store down,
slow, evicted meanwhile, corrupt bytes) returns 0 blocks and is logged, never raised to the
request path (unless `raise_errors=True`). After a failure the client skips calls for
`backoff_s`, so a dead store costs one fast error, not a timeout per request.

Buffers hold whole blocks back to back in the caller's KV layout (KVSpec.bytes_per_block
each): `fetch` fills `out_buf` with blocks [0, n); `put` sends from `blocks_buf`, which holds
blocks [first_block, len(hashes)).

Layered models (sliding-window layers; kvstore/window.py, kv/store_parts.py) move a block as
two parts: `lookup_parts` / `fetch_window` ask for a hit whose window parts are stored, and
`put(..., window=True)` publishes window parts. Uniform models never set a window field.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from pdserve.kv.transfer import UcxTransport, as_bytes
from pdserve.logging import get_logger
from pdserve.rpc.channels import make_channel
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

log = get_logger("pdserve.kvstore.client")
T = TypeVar("T")


def block_checksums(data: np.ndarray, bytes_per_block: int, n: int) -> list[bytes]:
    """blake2b-128 of each of the first `n` blocks of `data` (hashlib releases the GIL)."""
    return [
        hashlib.blake2b(
            memoryview(data[i * bytes_per_block : (i + 1) * bytes_per_block]), digest_size=16
        ).digest()
        for i in range(n)
    ]


class KVStoreClient:
    def __init__(
        self,
        addr: str,
        transport: UcxTransport,
        *,
        rpc_timeout_s: float = 1.0,
        transfer_timeout_s: float = 5.0,
        backoff_s: float = 2.0,
        raise_errors: bool = False,
    ) -> None:
        self.addr = addr
        self.transport = transport
        self.rpc_timeout_s = rpc_timeout_s
        self.transfer_timeout_s = transfer_timeout_s
        self.backoff_s = backoff_s
        self.raise_errors = raise_errors
        # gRPC's default reconnect backoff grows to 120 s while the store is down, and calls
        # fail fast until the next attempt: after a long outage a restarted store would stay
        # unused for up to 2 minutes. Cap it near our own backoff.
        reconnect_ms = max(500, int(backoff_s * 1000))
        self._channel = make_channel(
            addr,
            options=(
                ("grpc.initial_reconnect_backoff_ms", 500),
                ("grpc.min_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", reconnect_ms),
            ),
        )
        self._stub = kvstore_pb2_grpc.KVStoreStub(self._channel)
        self._down_until = 0.0
        self.failures = 0

    @property
    def available(self) -> bool:
        """False while backing off after a failure."""
        return time.monotonic() >= self._down_until

    async def _guard(self, what: str, default: T, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.available and not self.raise_errors:
            return default
        try:
            return await fn()
        except Exception as exc:
            self.failures += 1
            self._down_until = time.monotonic() + self.backoff_s
            if self.raise_errors:
                raise
            detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)
            log.warning("kvstore call failed", call=what, addr=self.addr, error=detail)
            return default

    # ----------------------------------------------------------------- lookup / fetch
    async def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        """Number of leading blocks of the chain the store holds now."""

        async def call() -> int:
            req = kvstore_pb2.LookupRequest(namespace=namespace, block_hashes=list(hashes))
            resp = await self._stub.Lookup(req, timeout=self.rpc_timeout_s)
            return int(resp.num_hit_blocks)

        return await self._guard("lookup", 0, call) if hashes else 0

    async def lookup_parts(
        self, namespace: str, hashes: Sequence[bytes], window_blocks: int
    ) -> tuple[int, int]:
        """A layered chain: (hit k, the stored main prefix); the hit's window parts
        [k - window_blocks, k) are stored. (0, 0) on failure."""

        async def call() -> tuple[int, int]:
            req = kvstore_pb2.LookupRequest(
                namespace=namespace, block_hashes=list(hashes), window_blocks=window_blocks
            )
            resp = await self._stub.Lookup(req, timeout=self.rpc_timeout_s)
            return int(resp.num_hit_blocks), int(resp.num_main_blocks)

        return await self._guard("lookup", (0, 0), call) if hashes else (0, 0)

    async def _fetch_into(
        self,
        buf: np.ndarray,
        namespace: str,
        hashes: Sequence[bytes],
        window_blocks: int,
        check: Callable[[kvstore_pb2.FetchResponse], None],
    ) -> kvstore_pb2.FetchResponse | None:
        """One Fetch into `buf`: the receive is posted before the store sends; `check`
        raises on a reply whose sizes do not match what `buf` expects. None = no block
        stored; otherwise the bytes have landed (checksums are the caller's to verify)."""
        tag = self.transport.new_tag_base()
        handle = self.transport.post_recv(buf, tag)
        try:
            req = kvstore_pb2.FetchRequest(
                namespace=namespace,
                block_hashes=list(hashes),
                ucx_worker_address=self.transport.address,
                tag=tag,
                window_blocks=window_blocks,  # 0 (uniform): the field is not on the wire
            )
            timeout = self.rpc_timeout_s + self.transfer_timeout_s
            resp = await self._stub.Fetch(req, timeout=timeout)
            if resp.num_blocks == 0:
                return None
            check(resp)
            await handle.wait(self.transfer_timeout_s)
        finally:
            await handle.cancel()  # no-op when done; retires it otherwise
        return resp

    async def fetch_window(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        window_blocks: int,
        main_bytes: int,
        window_bytes: int,
    ) -> tuple[int, np.ndarray, np.ndarray]:
        """A layered hit on `hashes`: (k, main parts [k, main_bytes], window parts
        [t, window_bytes] of blocks [k - t, k)), all verified; (0, ...) on any failure, and a
        bad window part fails the whole fetch (the hit needs every part it names)."""
        none = np.empty((0, main_bytes), np.uint8), np.empty((0, window_bytes), np.uint8)
        if not hashes:
            return 0, *none
        n, nw = len(hashes), min(len(hashes), window_blocks)
        buf = np.empty(n * main_bytes + nw * window_bytes, np.uint8)

        def check(resp: kvstore_pb2.FetchResponse) -> None:
            k, t = int(resp.num_blocks), int(resp.num_window_blocks)
            if (
                resp.bytes_per_block != main_bytes
                or (t and resp.window_bytes_per_block != window_bytes)
                or t != min(k, window_blocks)
                or len(resp.checksums) != k + t
            ):
                raise ValueError(
                    f"parts {resp.bytes_per_block}/{resp.window_bytes_per_block} B x "
                    f"{k}/{t}, expected {main_bytes}/{window_bytes} B"
                )

        async def call() -> tuple[int, np.ndarray, np.ndarray]:
            resp = await self._fetch_into(buf, namespace, hashes, window_blocks, check)
            if resp is None:
                return 0, *none
            k, t = int(resp.num_blocks), int(resp.num_window_blocks)
            main = buf[: k * main_bytes]
            window = buf[k * main_bytes : k * main_bytes + t * window_bytes]
            got = await asyncio.to_thread(block_checksums, main, main_bytes, k)
            got += await asyncio.to_thread(block_checksums, window, window_bytes, t)
            if got != list(resp.checksums):
                log.warning("kvstore fetch: checksum mismatch", blocks=k, window_blocks=t)
                return 0, *none
            return k, main.reshape(k, main_bytes), window.reshape(t, window_bytes)

        return await self._guard("fetch", (0, *none), call)

    async def fetch(self, namespace: str, hashes: Sequence[bytes], out_buf: Any) -> int:
        """Fill `out_buf` (len(hashes) blocks) with the stored prefix; returns the number of
        leading blocks received and verified (0 on any failure; later bytes are garbage)."""
        if not hashes:
            return 0
        out = as_bytes(out_buf, writable=True)
        if out.nbytes % len(hashes):
            raise ValueError("out_buf must hold exactly len(hashes) blocks")
        bpb = out.nbytes // len(hashes)

        def check(resp: kvstore_pb2.FetchResponse) -> None:
            if resp.bytes_per_block != bpb or len(resp.checksums) != resp.num_blocks:
                raise ValueError(f"block size {resp.bytes_per_block} B, expected {bpb} B")

        async def call() -> int:
            resp = await self._fetch_into(out, namespace, hashes, 0, check)
            if resp is None:
                return 0
            n = int(resp.num_blocks)
            got = await asyncio.to_thread(block_checksums, out, bpb, n)
            ok = next((i for i in range(n) if got[i] != resp.checksums[i]), n)
            if ok < n:
                log.warning("kvstore fetch: checksum mismatch", block=ok, blocks=n)
            return ok

        return await self._guard("fetch", 0, call)

    # ----------------------------------------------------------------- put
    async def put(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        first_block: int,
        blocks_buf: Any,
        window: bool = False,
    ) -> int:
        """Offer blocks [first_block, len(hashes)) of the chain; returns blocks stored.
        `window`: the blocks' window parts (a layered model; no parent rule)."""
        n_offered = len(hashes) - first_block
        if n_offered <= 0:
            return 0
        data = as_bytes(blocks_buf)
        if data.nbytes % n_offered:
            raise ValueError("blocks_buf must hold exactly len(hashes) - first_block blocks")
        bpb = data.nbytes // n_offered

        async def call() -> int:
            begin = kvstore_pb2.BeginPutRequest(
                namespace=namespace,
                block_hashes=list(hashes),
                first_block=first_block,
                bytes_per_block=bpb,
                window_part=window,
            )
            resp = await self._stub.BeginPut(begin, timeout=self.rpc_timeout_s)
            n = int(resp.num_accepted)
            if n == 0 or resp.first_block < first_block:
                return 0
            skip = (resp.first_block - first_block) * bpb
            chunk = data[skip : skip + n * bpb]
            send = self.transport.send(
                resp.ucx_worker_address, resp.tag, chunk, timeout_s=self.transfer_timeout_s
            )
            checksums, _ = await asyncio.gather(
                asyncio.to_thread(block_checksums, chunk, bpb, n), send
            )
            commit = kvstore_pb2.CommitPutRequest(put_id=resp.put_id, checksums=checksums)
            timeout = self.rpc_timeout_s + self.transfer_timeout_s
            done = await self._stub.CommitPut(commit, timeout=timeout)
            return int(done.num_stored)

        return await self._guard("put", 0, call)

    # ----------------------------------------------------------------- admin
    async def pin(self, namespace: str, hashes: Sequence[bytes], *, unpin: bool = False) -> int:
        async def call() -> int:
            req = kvstore_pb2.PinRequest(namespace=namespace, block_hashes=list(hashes))
            rpc = self._stub.Unpin if unpin else self._stub.Pin
            return int((await rpc(req, timeout=self.rpc_timeout_s)).num_blocks)

        return await self._guard("unpin" if unpin else "pin", 0, call)

    async def clear(self, namespace: str = "") -> int:
        async def call() -> int:
            req = kvstore_pb2.ClearRequest(namespace=namespace)
            return int((await self._stub.Clear(req, timeout=self.rpc_timeout_s)).num_blocks)

        return await self._guard("clear", 0, call)

    async def stats(self) -> kvstore_pb2.StatsResponse | None:
        async def call() -> kvstore_pb2.StatsResponse | None:
            return await self._stub.Stats(kvstore_pb2.StatsRequest(), timeout=self.rpc_timeout_s)

        return await self._guard("stats", None, call)

    async def close(self) -> None:
        await self._channel.close()
