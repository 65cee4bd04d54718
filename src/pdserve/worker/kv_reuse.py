"""KV reuse through the kvstore: fetch a prompt's cached prefix before prefill, publish new
full blocks after it, write a finished conversation back after decode.

The store is a cache, never a dependency: every call has a short deadline, a failure means
"no hit" (the prefill recomputes), and publishing runs off the critical path. Fetched bytes are
verified (per-block checksums, in KVStoreClient) before they enter the block pool.

Block bytes on the wire: one logical block = all layers, `[L, 2, block_size, kvh, head_dim]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

import torch

from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv.store_client import KVStoreClient
from pdserve.kv.transfer import UcxTransport
from pdserve.logging import get_logger

_log = get_logger(__name__)


class KVReuse:
    def __init__(
        self, addr: str, engine: AsyncEngine, transport: UcxTransport, timeout_s: float
    ) -> None:
        self._engine = engine
        llm = engine.engine
        self._spec = llm.spec
        self._namespace = llm.namespace
        self.client = KVStoreClient(
            addr, transport, rpc_timeout_s=timeout_s, transfer_timeout_s=2 * timeout_s
        )
        self._background: set[asyncio.Task] = set()
        self._counters: dict[str, float] = dict.fromkeys(
            ("lookups", "hit_blocks", "fetched_blocks", "fetch_ms_sum", "published_blocks",
             "lookup_ms_sum", "publish_failures"), 0.0
        )  # fmt: skip

    def counters(self) -> dict[str, float]:
        return {f"kvstore_{k}": v for k, v in self._counters.items()}

    # ------------------------------------------------------------------ fetch
    async def fetch_prefix(
        self, request_id: str, token_ids: Sequence[int], hold_finished: bool = False
    ) -> int:
        """Import the store's part of the prompt's cached prefix into the local block pool and
        hold the whole cached prefix until the request is scheduled; with `hold_finished`,
        also keep the request's blocks when it finishes, for `publish_later`. The caller
        must then add or abort `request_id` on the engine (abort releases every hold).
        Returns the tokens fetched from the store."""
        llm = self._engine.engine
        hashes = llm.compute_block_hashes(token_ids)
        wanted: list[bytes] = []
        if hashes:
            n_local = len(await self._engine.call(lambda: llm.cached_prefix(hashes)))
            if n_local < len(hashes):
                wanted = hashes[n_local : n_local + await self._lookup_beyond(hashes, n_local)]
        buf = torch.empty(
            (len(wanted), self._spec.num_layers, *self._spec.block_shape),
            dtype=getattr(torch, self._spec.dtype),
        )
        n_ok = 0
        if wanted:
            fetch_started = time.perf_counter()
            n_ok = await self.client.fetch(self._namespace, wanted, buf)
            self._counters["fetch_ms_sum"] += (time.perf_counter() - fetch_started) * 1e3
        verified = wanted[:n_ok]

        def import_and_hold() -> None:
            # One engine command: nothing can evict the prefix between import and hold.
            if n_ok:
                llm.import_cached_blocks(verified, buf[:n_ok])
            llm.hold_prefix(request_id, hashes)
            if hold_finished:
                llm.hold_on_finish(request_id)

        await self._engine.call(import_and_hold)
        self._counters["fetched_blocks"] += n_ok
        return n_ok * self._spec.block_size

    async def _lookup_beyond(self, hashes: Sequence[bytes], n_local: int) -> int:
        """How many blocks past the local `n_local` the store holds."""
        started = time.perf_counter()
        n_store = await self.client.lookup(self._namespace, hashes)
        self._counters["lookups"] += 1
        self._counters["lookup_ms_sum"] += (time.perf_counter() - started) * 1e3
        self._counters["hit_blocks"] += n_store
        return max(0, n_store - n_local)

    # ------------------------------------------------------------------ publish
    def publish_later(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Offer the full blocks of `token_ids` that sit in the local prefix cache to the
        store, in the background (prefill: the prompt; decode: prompt + answer), then
        release the request's holds (see `LLMEngine.hold_on_finish`)."""
        task = asyncio.ensure_future(self._publish(request_id, list(token_ids)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish(self, request_id: str, token_ids: list[int]) -> None:
        llm = self._engine.engine
        hashes = llm.compute_block_hashes(token_ids)
        try:
            n_store = await self.client.lookup(self._namespace, hashes) if hashes else 0
            if n_store >= len(hashes):
                return

            def read_local() -> torch.Tensor | None:
                # One engine call: the blocks cannot be evicted between lookup and copy.
                local = llm.cached_prefix(hashes)
                if len(local) <= n_store:
                    return None
                return llm.read_blocks(local[n_store:])

            data = await self._engine.call(read_local)
            if data is None:
                return
            chain = hashes[: n_store + data.shape[0]]
            stored = await self.client.put(self._namespace, chain, n_store, data)
            self._counters["published_blocks"] += stored
        except Exception as exc:  # a cache: never fail the request for it
            self._counters["publish_failures"] += 1
            _log.warning("kvstore publish failed", request_id=request_id, error=repr(exc))
        finally:
            await self.release(request_id)

    async def release(self, request_id: str) -> None:
        """Drop the engine's holds for `request_id` (after publishing, or instead of it)."""
        llm = self._engine.engine
        with contextlib.suppress(Exception):  # engine shut down: nothing left to hold
            await self._engine.call(lambda: llm.release_held(request_id))

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.client.close()
