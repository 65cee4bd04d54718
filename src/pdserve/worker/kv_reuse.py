"""KV reuse through the kvstore: fetch a prompt's cached prefix before prefill, publish new
full blocks after it, write a finished conversation back after decode.

The store is a cache, never a dependency: every call has a short deadline, a failure means
"no hit" (the prefill recomputes), and publishing runs off the critical path. Fetched bytes are
verified (per-block checksums, in KVStoreClient) before they enter the block pool.

Block bytes on the wire: one logical block = all layers, `[L, 2, block_size, kvh, head_dim]`.
A layered model with a sliding window group (Gemma 4) moves two parts instead
(kv/store_parts.py, kvstore/window.py): the main part (full-attention layers) of every block,
the window part (sliding layers) of the last `window_blocks` blocks of what is published
and fetched, the only ones a hit at the chain's end reads.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from pdserve.engine.async_engine import AsyncEngine
from pdserve.kv import store_parts
from pdserve.kv.store_client import KVStoreClient
from pdserve.kv.transfer import UcxTransport
from pdserve.logging import get_logger

# a trimmed decode's publish waits for the prefill's (see _publish): ~10 s at most
PUBLISH_RETRY_DELAYS_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 3.2)

_log = get_logger(__name__)


class KVReuse:
    """Built with the worker; `connect(addr)` once a kvstore address is known (from the
    settings or the router's Register reply). Until then `enabled` is False and every call
    is a no-op that releases what the engine holds."""

    def __init__(
        self, engine: AsyncEngine, transport: UcxTransport, timeout_s: float, fetch_link: Any = None
    ) -> None:
        self._engine = engine
        self._fetch_link = fetch_link  # emulation: the modelled fetch time (EmulatedLink)
        self._transport = transport
        self._timeout_s = timeout_s
        self._spec = engine.spec
        # layered (> 0): blocks move as main + window parts; importing one needs a window pool
        self._window_blocks = store_parts.window_blocks(engine.spec)
        self._can_import = not self._window_blocks or engine.num_window_blocks > 0
        self._kv_fingerprint = engine.kv_fingerprint  # the store's namespace for our blocks
        self.client: KVStoreClient | None = None
        self._background: set[asyncio.Task] = set()
        self._counters: dict[str, float] = dict.fromkeys(
            ("lookups", "hit_blocks", "fetched_blocks", "fetch_ms_sum", "published_blocks",
             "lookup_ms_sum", "publish_failures"), 0.0
        )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.client is not None

    def connect(self, addr: str) -> bool:
        """Use the kvstore at `addr` (idempotent; the first address wins). True if new."""
        if self.client is not None:
            return False
        t = self._timeout_s
        self.client = KVStoreClient(
            addr, self._transport, rpc_timeout_s=t, transfer_timeout_s=2 * t
        )
        return True

    def counters(self) -> dict[str, float]:
        return {f"kvstore_{k}": v for k, v in self._counters.items()} if self.enabled else {}

    # ------------------------------------------------------------------ fetch
    async def fetch_prefix(
        self, request_id: str, token_ids: Sequence[int], hold_finished: bool = False
    ) -> int:
        """Import the store's part of the prompt's cached prefix into the local block pool and
        hold the whole cached prefix until the request is scheduled; with `hold_finished`,
        also keep the request's blocks when it finishes, for `publish_later`. The caller
        must then add or abort `request_id` on the engine (abort releases every hold).
        Returns the tokens fetched from the store."""
        assert self.client is not None
        hashes = self._engine.compute_block_hashes(token_ids)
        wanted: list[bytes] = []
        if hashes and self._can_import:
            n_local = await self._engine.cached_prefix_length(hashes)
            if n_local < len(hashes):
                wanted = hashes[n_local : n_local + await self._lookup_beyond(hashes, n_local)]
        if self._window_blocks:
            buf, n_ok, window_from = await self._fetch_parts(wanted)
        else:
            buf = self._engine.empty_kv(self._spec.blocks_shape(len(wanted)))
            n_ok, window_from = 0, 0
            if wanted:
                fetch_started = time.perf_counter()
                n_ok = await self.client.fetch(self._kv_fingerprint, wanted, buf)
                if self._fetch_link is not None and n_ok:
                    await asyncio.sleep(self._fetch_link.delay_s(buf[:n_ok].nbytes))
                self._counters["fetch_ms_sum"] += (time.perf_counter() - fetch_started) * 1e3
        await self._engine.import_and_hold(
            request_id, hashes, wanted[:n_ok], buf[:n_ok], hold_finished, window_from
        )
        self._counters["fetched_blocks"] += n_ok
        return n_ok * self._spec.block_size

    async def _fetch_parts(self, wanted: list[bytes]) -> tuple[Any, int, int]:
        """A layered hit on the chain `wanted`: (whole blocks [k, ...], k, the first block
        whose sliding layers were fetched)."""
        assert self.client is not None
        k, window_from = 0, 0
        main_b, win_b = store_parts.part_bytes(self._spec)
        if wanted:
            started = time.perf_counter()
            k, main, window = await self.client.fetch_window(
                self._kv_fingerprint, wanted, self._window_blocks, main_b, win_b
            )
            if self._fetch_link is not None and k:
                await asyncio.sleep(self._fetch_link.delay_s(main.nbytes + window.nbytes))
            self._counters["fetch_ms_sum"] += (time.perf_counter() - started) * 1e3
        buf = self._engine.empty_kv(self._spec.blocks_shape(k))
        if k:
            # a copy of every fetched byte: off the event loop
            await asyncio.to_thread(store_parts.join, self._spec, main, window, buf)
            window_from = k - window.shape[0]
        return buf, k, window_from

    async def _lookup_beyond(self, hashes: Sequence[bytes], n_local: int) -> int:
        """How many blocks past the local `n_local` the store holds."""
        assert self.client is not None
        started = time.perf_counter()
        if self._window_blocks:
            n_store, _ = await self.client.lookup_parts(
                self._kv_fingerprint, hashes, self._window_blocks
            )
        else:
            n_store = await self.client.lookup(self._kv_fingerprint, hashes)
        self._counters["lookups"] += 1
        self._counters["lookup_ms_sum"] += (time.perf_counter() - started) * 1e3
        self._counters["hit_blocks"] += n_store
        return max(0, n_store - n_local)

    # ------------------------------------------------------------------ publish
    def finish(self, request_id: str, token_ids: Sequence[int], publish: bool) -> None:
        """After a stream: publish its blocks in the background (which then releases them),
        or just release what the engine held for it."""
        if publish and self.enabled:
            self.publish_later(request_id, token_ids)
        else:
            self._engine.release_nowait(request_id)

    def publish_later(self, request_id: str, token_ids: Sequence[int]) -> None:
        """Offer the full blocks of `token_ids` that sit in the local prefix cache to the
        store, in the background (prefill: the prompt; decode: prompt + answer), then
        release the request's holds (see `LLMEngine.hold_on_finish`)."""
        task = asyncio.ensure_future(self._publish(request_id, list(token_ids)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish(self, request_id: str, token_ids: list[int]) -> None:
        assert self.client is not None
        hashes = self._engine.compute_block_hashes(token_ids)
        if self._window_blocks:
            try:
                await self._publish_parts(hashes)
            except Exception as exc:  # a cache: never fail the request for it
                self._counters["publish_failures"] += 1
                _log.warning("kvstore publish failed", request_id=request_id, error=repr(exc))
            finally:
                self._engine.release_nowait(request_id)
            return
        try:
            n_store = await self.client.lookup(self._kv_fingerprint, hashes) if hashes else 0
            if n_store >= len(hashes):
                return
            # one engine command: the blocks cannot be evicted between lookup and copy
            data = await self._engine.read_for_publish(hashes, n_store)
            # A decode of a layered model holds no sliding-layer KV for the head of its prompt
            # (its transfer was trimmed to the window): it can only extend a chain the store
            # already holds. Wait (bounded) for the prefill's own publish of the prompt.
            retries = iter(PUBLISH_RETRY_DELAYS_S if self._spec.layers is not None else ())
            while data is None and (delay := next(retries, None)) is not None:
                await asyncio.sleep(delay)
                n_store = await self.client.lookup(self._kv_fingerprint, hashes)
                if n_store >= len(hashes):
                    return
                data = await self._engine.read_for_publish(hashes, n_store)
            if data is None:
                return
            chain = hashes[: n_store + data.shape[0]]
            stored = await self.client.put(self._kv_fingerprint, chain, n_store, data)
            self._counters["published_blocks"] += stored
        except Exception as exc:  # a cache: never fail the request for it
            self._counters["publish_failures"] += 1
            _log.warning("kvstore publish failed", request_id=request_id, error=repr(exc))
        finally:
            self._engine.release_nowait(request_id)

    async def _publish_parts(self, hashes: list[bytes]) -> None:
        """Layered publish of the chain `hashes` (N blocks): main parts of the blocks the
        store lacks, window parts of the last `window_blocks` blocks [N - T, N)."""
        assert self.client is not None
        fp, wb, n = self._kv_fingerprint, self._window_blocks, len(hashes)
        if not n:
            return
        hit, n_main = await self.client.lookup_parts(fp, hashes, wb)
        if hit >= n:
            return
        data = await self._engine.read_for_publish(hashes, n_main) if n_main < n else None
        # A decode holds no sliding-layer KV for the head of its prompt (its transfer was
        # trimmed to the window) and registers none of it: it can only extend a chain the
        # store already holds. Wait (bounded) for the prefill's own publish of the prompt.
        retries = iter(PUBLISH_RETRY_DELAYS_S)
        while data is None and n_main < n and (delay := next(retries, None)) is not None:
            await asyncio.sleep(delay)
            hit, n_main = await self.client.lookup_parts(fp, hashes, wb)
            if hit >= n:
                return
            data = await self._engine.read_for_publish(hashes, n_main) if n_main < n else None
        end, window = n_main, None
        if data is not None:
            m = data.shape[0]
            main, window = await asyncio.to_thread(store_parts.split, self._spec, data, m)
            stored = await self.client.put(fp, hashes[: n_main + m], n_main, main)
            self._counters["published_blocks"] += stored
            end = n_main + m
            if stored < m:  # no room (or raced): window parts only where main parts are
                _, end = await self.client.lookup_parts(fp, hashes[:end], wb)
                if end < n_main:  # evicted meanwhile: publish no window part now
                    return
                window = window[: end - n_main]
        start = max(0, end - wb)  # window parts for [start, end)
        first = max(start, n_main) if hit >= n_main else start
        if first < n_main:  # the store lacks some of [start, n_main): read them here
            head = await self._engine.read_for_publish(hashes[:n_main], first)
            if head is not None and head.shape[0] == n_main - first:
                _, head_w = await asyncio.to_thread(
                    store_parts.split, self._spec, head, head.shape[0]
                )
                window = head_w if window is None else np.concatenate([head_w, window])
            else:
                first = n_main
        if window is not None and first < end:
            window = window[len(window) - (end - first) :]
            await self.client.put(fp, hashes[:end], first, window, window=True)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        if self.client is not None:
            await self.client.close()
