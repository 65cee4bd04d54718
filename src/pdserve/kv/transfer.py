"""UcxTransport: tagged bulk-byte transfer between processes over UCX (ucxx). Torch-free.

Peers are named by their UCX *worker address* (a few hundred bytes carried in gRPC messages);
endpoints are made with `create_endpoint_from_worker_address(addr, endpoint_error_handling=False)`
so UCX picks shared memory / CMA on one host. With error handling off UCX never reports a dead
peer, so every send and receive here has a timeout.

Invariants:
- One UCX context per process (ucxx keeps a module-level one): transports created on the same
  event loop share it (reference counted); the last `close()` resets it.
- A receive is *posted* (matched by tag on this worker) when `post_recv` returns, so a peer may
  send before the caller awaits, or even before the peer has connected.
- Tickets are unguessable and single use: `new_ticket` draws 48 random bits (a stray sender
  on the network must guess the exact tag of a live receive; UCX matches only exact tags), a
  ticket is never issued twice within the last TICKET_MEMORY tickets, and a timed-out receive is retired
  by sending a zero-byte message with its tag to our own worker, so a late peer can never write
  into a buffer the caller has taken back (its message stays unmatched in UCX instead).
- A message shorter than the posted buffer completes the receive without an error and without
  a length: callers verify content (kvstore checksums) or sizes out of band.
- Progress: ucxx "thread" mode (a C++ progress thread) + Python futures (a notifier thread that
  completes asyncio futures on our loop): awaiting a transfer never spins the event loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import secrets
import time
from typing import Any

import numpy as np

from pdserve.errors import DeadlineError, UnavailableError
from pdserve.kv.transfer_buffers import as_bytes
from pdserve.logging import get_logger
from pdserve.rpc.metrics import Metrics

__all__ = [
    "RecvHandle",
    "TransferFailedError",
    "TransferTimeoutError",
    "UcxTransport",
    "as_bytes",
    "make_tag",
    "tag_base",
]

log = get_logger(__name__)

# UCX warns about UCX_MEMTYPE_CACHE (set by ucxx itself) being unused: silence it before import.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

LAYER_BITS = 16  # tag = ticket_id << 16 | layer: 65536 layers/messages per ticket
TICKET_MASK = (1 << (64 - LAYER_BITS)) - 1
TICKET_MEMORY = 1 << 16  # recently issued tickets never issued again


def tag_base(ticket_id: int) -> int:
    """First tag of a ticket; message l of the ticket uses `tag_base(t) + l`."""
    return (ticket_id & TICKET_MASK) << LAYER_BITS


def make_tag(ticket_id: int, layer: int) -> int:
    """64-bit tag for message `layer` of `ticket_id` (distinct tickets never collide)."""
    if not 0 <= layer < (1 << LAYER_BITS):
        raise ValueError(f"layer must be in [0, {1 << LAYER_BITS}), got {layer}")
    return tag_base(ticket_id) | layer


class TransferTimeoutError(DeadlineError):
    """Nothing (or not everything) arrived in time; the receive was retired."""


class TransferFailedError(UnavailableError):
    """A send failed or timed out (peer dead or gone); its endpoint was dropped."""


class _TransferMetrics:
    """Prometheus side of the counters (declared once per registry, see pdserve.rpc.metrics)."""

    def __init__(self, metrics: Metrics) -> None:
        self.bytes = metrics.counter("kv_transfer_bytes", "KV bytes moved over UCX", ["direction"])
        self.msgs = metrics.counter("kv_transfer_messages", "UCX messages done", ["direction"])
        self.fails = metrics.counter(
            "kv_transfer_failures", "send failures / receive timeouts", ["kind"]
        )
        self.seconds = metrics.histogram(
            "kv_transfer_seconds",
            "send start / receive post to completion, seconds",
            ["direction"],
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
        )


class _Context:
    """Reference-counted process UCX context bound to one event loop."""

    loop: asyncio.AbstractEventLoop | None = None
    users = 0

    @classmethod
    def acquire(cls) -> Any:
        import ucxx
        import ucxx.core

        loop = asyncio.get_running_loop()
        if cls.users and cls.loop is not loop:
            raise RuntimeError("the process UCX context is bound to another event loop")
        if cls.users == 0:
            ucxx.init(progress_mode="thread", enable_python_future=True)
            cls.loop = loop
        cls.users += 1
        ctx = ucxx.core._get_ctx()  # the ApplicationContext (worker, address)
        # The notifier thread fills the pool of Python futures asynchronously; a request made
        # before that works but makes UCXX print a warning on stdout: fill it now.
        ctx.worker.populate_python_futures_pool()
        return ctx

    @classmethod
    def release(cls) -> None:
        import gc

        import ucxx

        cls.users -= 1
        if cls.users > 0:
            return
        cls.loop = None
        gc.collect()  # drop dead endpoints/requests still referencing the context
        try:
            ucxx.stop_notifier_thread()
            ucxx.reset()
        except Exception as exc:  # a stray reference: the context lives until exit
            log.warning("ucx reset failed", error=repr(exc))


class RecvHandle:
    """A posted receive. `await h.wait(timeout_s)`; `h.cancel()` retires it (idempotent)."""

    def __init__(self, transport: UcxTransport, buf: np.ndarray, tag: int, request: Any) -> None:
        self.tag = tag
        self.nbytes = buf.nbytes
        self._transport = transport
        self._started = time.perf_counter()
        self._buf = buf  # keeps the memory alive while UCX may write into it
        self._retired = False
        self.task: asyncio.Task = asyncio.ensure_future(request.wait())
        self.task.add_done_callback(self._count_once)  # (it reads a failure too)

    def _count_once(self, task: asyncio.Task) -> None:
        """Count the message when it arrives, exactly once, whoever waits for it (or nobody:
        a receive that completed before its request was aborted still moved its bytes). A
        receive retired first is matched by our own empty message: not counted."""
        if task.cancelled() or task.exception() is not None or self._retired:
            return
        self._transport._count_recv(self.nbytes, time.perf_counter() - self._started)

    @property
    def done(self) -> bool:
        return self.task.done()

    async def wait(self, timeout_s: float) -> None:
        """Wait for the message; on timeout retire the receive and raise TransferTimeoutError."""
        done, _ = await asyncio.wait({self.task}, timeout=timeout_s)
        if not done or self._retired:
            await self.cancel()
            self._transport._count_timeout()
            raise TransferTimeoutError(f"no message with tag {self.tag:#x} in {timeout_s:.3g}s")
        exc = self.task.exception()
        if exc is not None:
            self._transport._count_timeout()
            raise TransferFailedError(f"receive tag {self.tag:#x} failed: {exc}") from exc

    async def cancel(self, settle_s: float = 1.0) -> None:
        """Retire the receive: match it with a zero-byte message from ourselves, then wait
        (bounded) until UCX let go of the buffer."""
        if self.task.done() or self._retired:
            self._retired = True
            return
        self._retired = True
        with contextlib.suppress(Exception):
            await self._transport._send_self_empty(self.tag)
        await asyncio.wait({self.task}, timeout=settle_s)
        if not self.task.done():
            log.warning("receive still held by UCX after cancel", tag=hex(self.tag))


class UcxTransport:
    """Create inside the running loop: `t = await UcxTransport.create()`; `await t.close()`."""

    def __init__(self, metrics: Metrics | None = None) -> None:
        self._metrics = _TransferMetrics(metrics if metrics is not None else Metrics())
        self._ctx: Any = None
        self.address: bytes = b""
        self._endpoints: dict[bytes, Any] = {}
        self._ep_locks: dict[bytes, asyncio.Lock] = {}
        self._self_ep: Any = None
        self._recent: collections.deque[int] = collections.deque(maxlen=TICKET_MEMORY)
        self._recent_set: set[int] = set()
        self._closed = False
        self.counters: dict[str, float] = dict.fromkeys(
            ("bytes_sent", "bytes_received", "transfers_sent", "transfers_received",
             "send_failures", "recv_timeouts", "seconds_sending", "seconds_receiving"), 0
        )  # fmt: skip

    @classmethod
    async def create(cls, metrics: Metrics | None = None) -> UcxTransport:
        t = cls(metrics)
        t._ctx = _Context.acquire()
        t.address = bytes(t._ctx.worker_address)
        return t

    # ------------------------------------------------------------------ tags
    def new_ticket(self) -> int:
        """A fresh, random ticket id for receives on this worker: tags
        `make_tag(ticket, 0..65535)`. 48 bits from `secrets` (unguessable), never 0, and
        distinct from the last TICKET_MEMORY tickets (single use)."""
        while True:
            ticket = secrets.randbits(64 - LAYER_BITS) & TICKET_MASK
            if ticket and ticket not in self._recent_set:
                break
        if len(self._recent) == self._recent.maxlen:
            self._recent_set.discard(self._recent[0])
        self._recent.append(ticket)
        self._recent_set.add(ticket)
        return ticket

    def new_tag_base(self) -> int:
        return tag_base(self.new_ticket())

    # ------------------------------------------------------------------ receive
    def post_recv(self, buf: Any, tag: int) -> RecvHandle:
        """Post a receive of up to `buf.nbytes` bytes with `tag` into `buf` (numpy array or
        contiguous CPU tensor, written in place). Returns at once; the receive is posted."""
        from ucxx._lib.arr import Array
        from ucxx.types import Tag

        self._check_open()
        view = as_bytes(buf, writable=True)
        request = self._ctx.worker.tag_recv(Array(view), Tag(tag))
        return RecvHandle(self, view, tag, request)

    async def recv(self, buf: Any, tag: int, timeout_s: float) -> None:
        await self.post_recv(buf, tag).wait(timeout_s)

    # ------------------------------------------------------------------ send
    async def send(self, peer_address: bytes, tag: int, buf: Any, timeout_s: float = 30.0) -> None:
        """Send `buf` to the peer's worker with `tag`. Raises TransferFailedError (endpoint
        dropped) if the peer is unreachable or the send does not complete in `timeout_s`."""
        self._check_open()
        view = as_bytes(buf, writable=False)
        started = time.perf_counter()
        try:
            ep = await self._endpoint(peer_address)
        except Exception as exc:
            self._count_send_failure()
            raise TransferFailedError(f"cannot reach UCX peer: {exc}") from exc
        task = asyncio.ensure_future(ep.send(view, tag=tag, force_tag=True))
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
        if not done or task.exception() is not None:
            # The task keeps `view` alive; aborting the endpoint cancels its requests.
            self._drop_endpoint(peer_address, ep)
            self._count_send_failure()
            why = "timed out" if not done else repr(task.exception())
            raise TransferFailedError(f"send tag {tag:#x} ({view.nbytes} B) {why}")
        elapsed = time.perf_counter() - started
        self.counters["bytes_sent"] += view.nbytes
        self.counters["transfers_sent"] += 1
        self.counters["seconds_sending"] += elapsed
        m = self._metrics
        m.bytes.labels("sent").inc(view.nbytes)
        m.msgs.labels("sent").inc()
        m.seconds.labels("send").observe(elapsed)

    async def _endpoint(self, peer_address: bytes) -> Any:
        ep = self._endpoints.get(peer_address)
        if ep is not None:
            return ep
        lock = self._ep_locks.setdefault(peer_address, asyncio.Lock())
        async with lock:
            ep = self._endpoints.get(peer_address)
            if ep is None:
                ep = await self._connect(peer_address)
                self._endpoints[peer_address] = ep
        return ep

    async def _connect(self, peer_address: bytes) -> Any:
        import ucxx

        # UCX aborts the process (an assertion) on a malformed address: check the packed
        # header's version nibble against our own address before handing it over.
        if len(peer_address) < 16 or (peer_address[0] ^ self.address[0]) & 0x0F:
            raise ValueError("not a UCX worker address of this UCX version")
        address = ucxx.get_ucx_address_from_buffer(peer_address)
        return await self._ctx.create_endpoint_from_worker_address(
            address, endpoint_error_handling=False
        )

    def _drop_endpoint(self, peer_address: bytes, ep: Any) -> None:
        if self._endpoints.get(peer_address) is ep:
            del self._endpoints[peer_address]
        with contextlib.suppress(Exception):
            ep.abort()

    async def _send_self_empty(self, tag: int) -> None:
        if self._self_ep is None:
            self._self_ep = await self._connect(self.address)
        await asyncio.wait_for(
            self._self_ep.send(np.empty(0, np.uint8), tag=tag, force_tag=True), 1.0
        )

    # ------------------------------------------------------------------ bookkeeping
    def _count_recv(self, nbytes: int, elapsed: float) -> None:
        self.counters["bytes_received"] += nbytes
        self.counters["transfers_received"] += 1
        self.counters["seconds_receiving"] += elapsed
        m = self._metrics
        m.bytes.labels("received").inc(nbytes)
        m.msgs.labels("received").inc()
        m.seconds.labels("recv").observe(elapsed)

    def _count_timeout(self) -> None:
        self.counters["recv_timeouts"] += 1
        self._metrics.fails.labels("recv_timeout").inc()

    def _count_send_failure(self) -> None:
        self.counters["send_failures"] += 1
        self._metrics.fails.labels("send_failure").inc()

    def counters_snapshot(self) -> dict[str, float]:
        """For WorkerInfo.counters: `ucx_<name>` -> value."""
        return {f"ucx_{k}": float(v) for k, v in self.counters.items()}

    @property
    def num_endpoints(self) -> int:
        return len(self._endpoints)

    def _check_open(self) -> None:
        if self._closed:
            raise TransferFailedError("transport is closed")

    async def close(self) -> None:
        """Abort every endpoint and release the process UCX context (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for ep in [*self._endpoints.values(), self._self_ep]:
            if ep is not None:
                with contextlib.suppress(Exception):
                    ep.abort()
        self._endpoints.clear()
        self._self_ep = None
        self._ctx = None
        _Context.release()
