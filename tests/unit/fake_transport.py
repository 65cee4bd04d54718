"""An in-process stand-in for UcxTransport (tagged send/receive between handlers of one
process), for unit tests of the prefill and decode handlers. Same contract as the real one:
`post_recv` returns a handle with `task`, `done`, `wait(timeout)` and `cancel()`; `send` copies
into the receive posted with that tag, or fails (TransferFailedError) when none is posted."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import torch

from pdserve.kv.transfer import TransferFailedError, TransferTimeoutError


class FakeRecv:
    def __init__(self, transport: FakeTransport, buf: Any, tag: int) -> None:
        self.tag = tag
        self.buf = buf
        self._transport = transport
        self.task: asyncio.Future = asyncio.get_running_loop().create_future()
        self._retired = False

    @property
    def done(self) -> bool:
        return self.task.done()

    async def wait(self, timeout_s: float) -> None:
        done, _ = await asyncio.wait({self.task}, timeout=timeout_s)
        if not done or self._retired:
            await self.cancel()
            raise TransferTimeoutError(f"no message with tag {self.tag:#x} in {timeout_s:.3g}s")

    async def cancel(self) -> None:
        self._retired = True
        self._transport.posted.pop(self.tag, None)
        if not self.task.done():
            self.task.set_result(None)


class FakeTransport:
    address = b"fake-ucx-worker"

    def __init__(self) -> None:
        self.posted: dict[int, FakeRecv] = {}
        self._next = 1 << 12
        self.sends = 0
        self.send_delay_s = 0.0

    def new_tag_base(self) -> int:
        self._next += 1 << 8
        return self._next

    def post_recv(self, buf: Any, tag: int) -> FakeRecv:
        handle = FakeRecv(self, buf, tag)
        self.posted[tag] = handle
        return handle

    async def send(self, peer: bytes, tag: int, buf: Any, timeout_s: float = 30.0) -> None:
        await asyncio.sleep(self.send_delay_s)
        handle = self.posted.pop(tag, None)
        if handle is None:
            raise TransferFailedError(f"no receive posted for tag {tag:#x}")
        if isinstance(handle.buf, np.ndarray):  # a shorter message fills a prefix, as in UCX
            data = np.asarray(buf).reshape(-1)
            handle.buf.reshape(-1)[: data.size] = data
        else:
            handle.buf.copy_(torch.as_tensor(buf))
        self.sends += 1
        handle.task.set_result(None)

    def counters_snapshot(self) -> dict[str, float]:
        return {"transfers_sent": float(self.sends)}
