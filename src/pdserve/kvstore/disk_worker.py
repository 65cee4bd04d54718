"""DiskWorker: moves the kvstore's blocks between the arena and the disk tier, off the loop.

One background task writes committed blocks through to disk and deletes the files of removed
blocks, in batches, each batch in a worker thread (the event loop never does file I/O). The
store's bookkeeping stays on the loop (BlockStore.take_writes / finish_writes / take_unlinks).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from pdserve.kvstore.blocks import Block
from pdserve.kvstore.disk import DiskFiles
from pdserve.kvstore.store import BlockStore
from pdserve.logging import get_logger

log = get_logger("pdserve.kvstore")

BATCH_BYTES = 64 << 20  # one thread hop writes at most this much


class DiskWorker:
    def __init__(self, store: BlockStore, files: DiskFiles) -> None:
        self.store = store
        self.files = files
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def open(self) -> int:
        """Adopt the block files already on disk (a restart). Returns blocks adopted."""
        metas, bad = await asyncio.to_thread(self.files.scan)
        for name in bad:
            log.warning("kvstore disk: unreadable block file dropped", file=name)
        n = self.store.disk.adopt(metas)
        self.store.disk.drop_files(bad)
        log.info("kvstore disk tier opened", dir=str(self.files.dir), blocks=n,
                 bytes=self.store.index.disk_used)  # fmt: skip
        self.wake()
        return n

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def wake(self) -> None:
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            while await self.run_once():
                pass

    async def run_once(self) -> bool:
        """Write one batch and delete the pending files; False when there was nothing."""
        blocks = self.store.disk.take_writes(BATCH_BYTES)
        unlinks = self.store.disk.take_unlinks()
        if not blocks and not unlinks:
            return False
        ok = [False] * len(blocks)
        try:
            ok = await asyncio.to_thread(self._io, blocks, unlinks)
        finally:  # also when cancelled: the blocks' refs must go back
            self.store.disk.finish_writes(blocks, ok)
        return True

    def _io(self, blocks: list[Block], unlinks: list[str]) -> list[bool]:
        for name in unlinks:
            try:
                self.files.unlink(name)
            except OSError as exc:
                log.warning("kvstore disk: unlink failed", file=name, error=repr(exc))
        out = []
        for blk in blocks:
            assert blk.slot is not None  # referenced since take_writes: its RAM copy stays
            try:
                self.files.write(blk.disk_name, blk.meta(), self.store.arena.view(blk.slot))
                out.append(True)
            except OSError as exc:
                log.warning("kvstore disk: write failed", file=blk.disk_name, error=repr(exc))
                out.append(False)
        return out

    async def close(self, flush_s: float = 10.0) -> None:
        """Stop; first write what is queued (for at most `flush_s`) so a restart finds it."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        deadline = time.monotonic() + flush_s
        while time.monotonic() < deadline and await self.run_once():
            pass
