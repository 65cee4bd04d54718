"""KVStoreService: the store's operations over UCX, in domain types (the servicer maps protos).

Runs on the service's event loop; byte work (gather, checksum + copy) goes to worker threads
and touches only referenced or reserved slots (see BlockStore). Staging buffers (one per open
put or fetch) live outside the arena; their total is bounded by `staging_bytes`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.errors import (
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PermissionDeniedError,
    UnavailableError,
)
from pdserve.kv.transfer import RecvHandle, TransferFailedError, UcxTransport
from pdserve.kvstore.blocks import Block
from pdserve.kvstore.disk import DiskFiles
from pdserve.kvstore.disk_worker import DiskWorker
from pdserve.kvstore.metrics import KVStoreMetrics
from pdserve.kvstore.settings import KVStoreSettings
from pdserve.kvstore.stats import StoreStats
from pdserve.kvstore.store import BlockStore, PutReservation
from pdserve.logging import get_logger

log = get_logger("pdserve.kvstore")


@dataclass
class FetchResult:
    num_blocks: int
    bytes_per_block: int
    checksums: list[bytes]  # main parts (whole blocks), then window parts
    num_window_blocks: int = 0  # layered: window parts of the last blocks (kvstore/window.py)
    window_bytes_per_block: int = 0


@dataclass
class PutTicket:
    put_id: int
    tag: int
    num_accepted: int
    first_block: int


@dataclass
class _OpenPut:
    res: PutReservation
    staging: np.ndarray  # [num_accepted * block_bytes] uint8, the UCX receive buffer
    handle: RecvHandle
    deadline: float
    writer: str = ""


class KVStoreService:
    def __init__(
        self,
        settings: KVStoreSettings,
        transport: UcxTransport,
        metrics: KVStoreMetrics,
    ) -> None:
        self.settings = settings
        self.transport = transport
        self.metrics = metrics
        disk_bytes = settings.disk_bytes if settings.disk_dir else 0
        self.store = BlockStore(settings.capacity_bytes, settings.block_bytes, 0, disk_bytes)
        self.disk: DiskWorker | None = None
        if settings.disk_dir and disk_bytes:
            self.disk = DiskWorker(self.store, DiskFiles(settings.disk_dir))
        self._open: dict[int, _OpenPut] = {}
        self._staging_in_use = 0
        self._reaper: asyncio.Task | None = None

    @property
    def address(self) -> bytes:
        return self.transport.address

    async def start(self) -> None:
        """Adopt the disk tier's files (a restart), then start the background tasks."""
        if self.disk is not None:
            await self.disk.open()
            self.disk.start()
        self._reaper = asyncio.create_task(self._reap_loop())

    # ----------------------------------------------------------------- lookup / fetch
    def lookup(self, namespace: str, hashes: Sequence[bytes]) -> int:
        n = self.store.lookup(namespace, hashes)
        self.metrics.lookups.inc()
        self.metrics.hit_blocks.inc(n)
        self.metrics.miss_blocks.inc(len(hashes) - n)
        return n

    def lookup_window(
        self, namespace: str, hashes: Sequence[bytes], window_blocks: int
    ) -> tuple[int, int]:
        """A layered model's hit: (k, stored main prefix), see BlockStore.lookup_window."""
        k, main = self.store.windows.lookup(namespace, hashes, window_blocks)
        self.metrics.lookups.inc()
        self.metrics.hit_blocks.inc(k)
        self.metrics.miss_blocks.inc(len(hashes) - k)
        return k, main

    def bytes_per_block(self, namespace: str, hashes: Sequence[bytes]) -> int:
        return self.store.block_bytes_of(namespace, hashes) or self.settings.block_bytes

    async def fetch(
        self, namespace: str, hashes: Sequence[bytes], peer: bytes, tag: int, window_blocks: int = 0
    ) -> FetchResult:
        """Send the stored prefix of `hashes` as one message with `tag` to `peer`. Layered
        (`window_blocks` > 0): the hit's main parts, then the window parts of its last
        min(k, window_blocks) blocks (kvstore/window.py); all or nothing on a bad file."""
        started = time.perf_counter()
        empty = FetchResult(0, self.settings.block_bytes, [])
        if window_blocks:
            main, parts = self.store.windows.acquire(namespace, hashes, window_blocks)
            if len({b.nbytes for b in main}) > 1 or len({b.nbytes for b in parts}) > 1:
                self.store.release(main + parts)  # one size per part: mixed layouts
                return empty
        else:
            main, parts = self.store.acquire(namespace, hashes), []
            if main:  # one message of one block size
                size = main[0].nbytes
                keep = next((i for i, b in enumerate(main) if b.nbytes != size), len(main))
                self.store.release(main[keep:])
                main = main[:keep]
        if not main:
            self.store.release(parts)
            return empty
        blocks = main + parts
        nbytes = sum(b.nbytes for b in blocks)
        try:
            self._take_staging(nbytes)
        except OverloadedError:
            self.store.release(blocks)
            raise
        tier = "ram" if all(b.slot is not None for b in blocks) else "disk"
        sent = 0
        try:
            staging = np.empty(nbytes, np.uint8)
            files = self.disk.files if self.disk is not None else None
            good = await asyncio.to_thread(self.store.gather, blocks, staging, files)
            if good < len(blocks):  # a corrupt or short file: a miss from that block on
                log.warning("kvstore disk: corrupt block file", file=blocks[good].disk_name)
                self.store.disk.mark_bad(blocks[good])
                keep = 0 if parts else good  # a layered hit needs every part it names
                self.store.release(blocks[keep:])
                blocks, parts = blocks[:keep], []
                self._wake_disk()  # unlink the bad file
            if tier == "disk":
                await self._promote(blocks, staging)
            checksums = [b.checksum for b in blocks]
            sent = sum(b.nbytes for b in blocks)
            n_parts = len(parts)
            self.store.release(blocks)
            blocks = []
            if checksums:
                msg = staging[:sent]
                await self.transport.send(peer, tag, msg, timeout_s=self.settings.send_timeout_s)
        except TransferFailedError as exc:
            raise UnavailableError(f"fetch: cannot send to the caller: {exc}") from exc
        finally:
            self.store.release(blocks)
            self._staging_in_use -= nbytes
        if not checksums:
            return empty
        self.store.stats.bytes_out += sent
        self.metrics.fetched_bytes.inc(sent)
        elapsed = time.perf_counter() - started
        self.metrics.fetch_seconds.observe(elapsed)
        self.metrics.fetch_tier_seconds.labels(tier).observe(elapsed)
        n_main = len(checksums) - n_parts
        return FetchResult(
            n_main,
            main[0].nbytes,
            checksums,
            n_parts,
            parts[0].nbytes if n_parts else 0,
        )

    async def _promote(self, blocks: list[Block], staging: np.ndarray) -> None:
        """Copy the disk-only blocks a fetch read (now in `staging`) back into RAM slots."""
        pairs = self.store.disk.reserve_promotions(blocks)
        if not pairs:
            return
        offset, pos = {}, 0  # blocks lie back to back in `staging` (sizes may differ)
        for b in blocks:
            offset[id(b)] = pos
            pos += b.nbytes

        def copy() -> None:
            for blk, slot in pairs:
                i = offset[id(blk)]
                self.store.arena.view(slot)[:] = staging[i : i + blk.nbytes]

        try:
            await asyncio.to_thread(copy)
        finally:
            self.store.disk.finish_promotions(pairs)

    # ----------------------------------------------------------------- puts
    def begin_put(
        self,
        namespace: str,
        hashes: Sequence[bytes],
        first_block: int,
        block_bytes: int,
        writer: str = "",
        window: bool = False,
    ) -> PutTicket:
        """Reserve room for a put. Bounded: a put declares a block of at least
        `min_block_bytes`, at most `max_open_puts` are open at once, each is dropped after
        `put_timeout_s` if not committed, and their staging is capped by `staging_bytes`.
        `writer`: the identity of the caller; the stored blocks remember it, and only the
        same identity may commit the put. `window`: the blocks' window parts (a layered
        model, kvstore/window.py)."""
        if 0 < block_bytes < self.settings.min_block_bytes:
            raise InvalidRequestError(
                "bytes_per_block", f"must be at least {self.settings.min_block_bytes}"
            )
        if len(self._open) >= self.settings.max_open_puts:
            self.store.stats.put_rejected += 1
            self.metrics.puts.labels("rejected").inc()
            return PutTicket(0, 0, 0, first_block)
        res = self.store.begin_put(namespace, hashes, first_block, block_bytes, writer, window)
        if res is None:
            return PutTicket(0, 0, 0, len(hashes))
        if not res.slots:
            self.metrics.puts.labels("rejected").inc()
            return PutTicket(0, 0, 0, res.first_block)
        try:
            self._take_staging(res.nbytes)
        except OverloadedError:
            self.store.abort_put(res.put_id)
            self.store.stats.put_rejected += 1
            self.metrics.puts.labels("rejected").inc()
            return PutTicket(0, 0, 0, res.first_block)
        staging = np.empty(res.nbytes, np.uint8)
        tag = self.transport.new_tag_base()
        handle = self.transport.post_recv(staging, tag)
        deadline = time.monotonic() + self.settings.put_timeout_s
        self._open[res.put_id] = _OpenPut(res, staging, handle, deadline, writer)
        self.metrics.sync(self.store.snapshot())
        return PutTicket(res.put_id, tag, len(res.slots), res.first_block)

    async def commit_put(self, put_id: int, checksums: Sequence[bytes], writer: str = "") -> int:
        op = self._open.get(put_id)
        if op is None:
            raise NotFoundError(f"put {put_id} is unknown or expired")
        if op.writer != writer:
            raise PermissionDeniedError(f"put {put_id} belongs to another writer")
        self._open.pop(put_id)
        try:
            try:
                await op.handle.wait(self.settings.commit_wait_s)
                ok = await asyncio.to_thread(self.store.write_put, op.res, op.staging, checksums)
            except Exception as exc:  # nothing arrived, or the receive failed
                log.warning("put bytes missing", put_id=put_id, error=repr(exc))
                ok = False
            if not ok:
                self.store.abort_put(put_id, corrupt=True)
                self.metrics.puts.labels("corrupt").inc()
                return 0
            stored = self.store.commit_put(put_id, checksums)
            self._wake_disk()
            self.metrics.puts.labels("stored").inc()
            self.metrics.writer_blocks.labels(writer or "anonymous").inc(stored)
            return stored
        finally:
            self._staging_in_use -= op.staging.nbytes
            self.metrics.sync(self.store.snapshot())

    async def _drop_put(self, put_id: int) -> None:
        op = self._open.pop(put_id, None)
        if op is None:
            return
        await op.handle.cancel()
        self.store.abort_put(put_id)
        self._staging_in_use -= op.staging.nbytes
        self.metrics.puts.labels("expired").inc()
        self.metrics.sync(self.store.snapshot())

    async def _reap_loop(self) -> None:
        period = min(1.0, self.settings.put_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for put_id in [p for p, op in self._open.items() if op.deadline < now]:
                log.warning("put not committed in time: dropped", put_id=put_id)
                await self._drop_put(put_id)

    def _wake_disk(self) -> None:
        if self.disk is not None:
            self.disk.wake()

    def _take_staging(self, nbytes: int) -> None:
        if self._staging_in_use + nbytes > self.settings.staging_bytes:
            raise OverloadedError(
                f"kvstore staging full ({self._staging_in_use} + {nbytes} B "
                f"> {self.settings.staging_bytes} B)"
            )
        self._staging_in_use += nbytes

    # ----------------------------------------------------------------- admin
    def purge_writer(self, writer: str) -> tuple[int, int]:
        removed, in_use = self.store.admin.purge_writer(writer)
        self._wake_disk()  # delete the removed blocks' files
        log.warning("purged writer", writer=writer, blocks=removed, in_use=in_use)
        self.metrics.sync(self.store.snapshot())
        return removed, in_use

    def pin(self, namespace: str, hashes: Sequence[bytes], delta: int) -> int:
        return self.store.admin.pin(namespace, hashes, delta)

    def stats(self) -> StoreStats:
        s = self.store.snapshot()
        s.open_puts = len(self._open)
        s.staging_bytes = self._staging_in_use
        return s

    def clear(self, namespace: str) -> int:
        n = self.store.admin.clear(namespace)
        self._wake_disk()
        self.metrics.sync(self.store.snapshot())
        return n

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for put_id in list(self._open):
            await self._drop_put(put_id)
        if self.disk is not None:
            await self.disk.close()
