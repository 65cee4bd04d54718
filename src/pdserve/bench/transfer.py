"""`pdserve bench transfer`: KV transfer throughput between two processes over UCX, against a
plain memory copy (numpy copyto) of the same bytes in the same run.

The parent sends; a receiver subprocess (`python -m pdserve.bench.transfer --receiver ...`)
posts every receive of a batch up front, waits for all of them, then acks with one small UCX
message. A batch's time runs from the first send to the ack, so it covers delivery, not just
local send completion. Modes: `serial` (one message in flight, each awaited: the per-message
cost shows) and `pipelined` (`--inflight` messages in flight). Torch-free.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from pdserve.kv.spec import KVSpec

# One KV block of the ~50M bench model (make-tiny preset bench50m, float32): 8 layers * (K,V)
# * 16 tokens * 2 kv heads * 64 dims * 4 B = 128 KiB (64 KiB in bfloat16).
BENCH_BLOCK_BYTES = KVSpec(num_layers=8, num_kv_heads=2, head_dim=64, block_size=16,
                           dtype="float32").bytes_per_block  # fmt: skip
DEFAULT_SIZES = [BENCH_BLOCK_BYTES * n // 2 for n in (1, 2, 8, 32, 128, 1024)]  # 64 KiB .. 64 MiB
MEMCPY_SPAN = 256 << 20  # memcpy rotates over this many bytes of buffers: no cache-hot copies
MODES = ("serial", "pipelined")
RECV_BUFFER_BUDGET = 256 << 20  # receiver: rotating buffers per batch stay under this
ACK_TICKET = 1  # parent's receive tags: make_tag(ACK_TICKET, batch)


@dataclass
class Row:
    size_bytes: int
    blocks: float
    serial_gbps: float
    pipelined_gbps: float
    memcpy_gbps: float

    @property
    def serial_ratio(self) -> float:
        return self.serial_gbps / self.memcpy_gbps

    @property
    def pipelined_ratio(self) -> float:
        return self.pipelined_gbps / self.memcpy_gbps


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
    return int(float(text.rstrip("KMG")) * scale)


def fmt_size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def batches(sizes: list[int], repeats: int) -> list[tuple[int, int, str]]:
    """(batch index, size, mode) in the order both processes walk them: per size a warm-up
    batch (not timed), then the modes alternating `repeats` times (best of kept)."""
    out, b = [], 0
    for size in sizes:
        for mode in ("warmup", *(MODES * repeats)):
            out.append((b, size, mode))
            b += 1
    return out


def data_tag(batch: int, i: int) -> int:
    from pdserve.kv.transfer import make_tag

    return make_tag(1000 + batch, i)


# ---------------------------------------------------------------------------- receiver
async def _receive(peer: bytes, sizes: list[int], iters: int, repeats: int) -> None:
    from pdserve.kv.transfer import UcxTransport, make_tag

    t = await UcxTransport.create()
    sys.stdout.write(t.address.hex() + "\n")
    sys.stdout.flush()
    try:
        for b, size, _mode in batches(sizes, repeats):
            nbuf = max(1, min(iters, RECV_BUFFER_BUDGET // size))
            bufs = [np.empty(size, np.uint8) for _ in range(nbuf)]
            handles = [t.post_recv(bufs[i % nbuf], data_tag(b, i)) for i in range(iters)]
            await asyncio.gather(*(h.wait(120.0) for h in handles))
            await t.send(peer, make_tag(ACK_TICKET, b), np.zeros(8, np.uint8), timeout_s=30)
    finally:
        await t.close()


# ---------------------------------------------------------------------------- sender
async def _send_batch(t: Any, peer: bytes, b: int, buf: np.ndarray, iters: int, k: int) -> float:
    from pdserve.kv.transfer import make_tag

    ack = t.post_recv(np.empty(8, np.uint8), make_tag(ACK_TICKET, b))
    started = time.perf_counter()
    if k <= 1:
        for i in range(iters):
            await t.send(peer, data_tag(b, i), buf)
    else:
        window = asyncio.Semaphore(k)

        async def one(i: int) -> None:
            async with window:
                await t.send(peer, data_tag(b, i), buf)

        await asyncio.gather(*(one(i) for i in range(iters)))
    await ack.wait(120.0)
    return time.perf_counter() - started


def memcpy_gbps(size: int, iters: int, repeats: int) -> float:
    """numpy copyto of `size` bytes, `iters` times, best of `repeats`. Copies walk through
    MEMCPY_SPAN bytes written long before, so small sizes are not served from the CPU cache
    (KV blocks are not cache-hot either)."""
    span = max(size, MEMCPY_SPAN // size * size)
    src, dst = np.full(span, 7, np.uint8), np.ones(span, np.uint8)  # pages faulted in
    slots, best, k = span // size, float("inf"), 0
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(iters):
            off = (k % slots) * size
            np.copyto(dst[off : off + size], src[off : off + size])
            k += 1
        best = min(best, time.perf_counter() - started)
    return size * iters / best / 1e9


async def run_bench(sizes: list[int], iters: int, inflight: int, repeats: int) -> list[Row]:
    from pdserve.kv.transfer import UcxTransport

    t = await UcxTransport.create()
    argv = [sys.executable, "-m", "pdserve.bench.transfer", "--receiver", t.address.hex(),
            "--sizes", ",".join(map(str, sizes)), "--iters", str(iters),
            "--repeats", str(repeats)]  # fmt: skip
    child = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE)
    try:
        assert child.stdout is not None
        peer = b""
        while not peer:  # UCX may print log lines on stdout before the address
            line = await asyncio.wait_for(child.stdout.readline(), 120)
            if not line:
                raise RuntimeError("receiver exited before printing its address")
            with contextlib.suppress(ValueError):
                peer = bytes.fromhex(line.decode().strip())
        timings: dict[tuple[int, str], float] = {}
        for b, size, mode in batches(sizes, repeats):
            buf = np.random.default_rng(b).integers(0, 256, size=size, dtype=np.uint8)
            k = 1 if mode == "serial" else inflight
            took = await _send_batch(t, peer, b, buf, iters, k)
            timings[(size, mode)] = min(took, timings.get((size, mode), float("inf")))
        rows = []
        for size in sizes:
            gbps = {m: size * iters / timings[(size, m)] / 1e9 for m in MODES}
            rows.append(Row(size, size / BENCH_BLOCK_BYTES, gbps["serial"], gbps["pipelined"],
                            memcpy_gbps(size, iters, repeats)))  # fmt: skip
        return rows
    finally:
        await t.close()
        try:
            await asyncio.wait_for(child.wait(), 30)
        except asyncio.TimeoutError:
            child.kill()
            await child.wait()


def format_table(rows: list[Row], iters: int, inflight: int, repeats: int) -> str:
    head = (f"{'size':>9} {'blocks':>7} {'serial GB/s':>12} {'pipelined GB/s':>15} "
            f"{'memcpy GB/s':>12} {'serial/memcpy':>14} {'pipelined/memcpy':>17}")  # fmt: skip
    lines = [f"UCX transfer between two processes: {iters} messages per size and mode, best of "
             f"{repeats}; pipelined = {inflight} in flight; memcpy = numpy copyto, cache-cold; "
             f"block = one bench50m KV block ({fmt_size(BENCH_BLOCK_BYTES)})",
             head, "-" * len(head)]  # fmt: skip
    for r in rows:
        lines.append(
            f"{fmt_size(r.size_bytes):>9} {r.blocks:>7.1f} {r.serial_gbps:>12.2f} "
            f"{r.pipelined_gbps:>15.2f} {r.memcpy_gbps:>12.2f} {r.serial_ratio:>13.2f}x "
            f"{r.pipelined_ratio:>16.2f}x"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else DEFAULT_SIZES
    if args.receiver:
        asyncio.run(_receive(bytes.fromhex(args.receiver), sizes, args.iters, args.repeats))
        return 0
    rows = asyncio.run(run_bench(sizes, args.iters, args.inflight, args.repeats))
    print(format_table(rows, args.iters, args.inflight, args.repeats))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--sizes",
        default=None,
        help="message sizes, e.g. 64K,1M,64M (default: 1..1024 bench blocks)",
    )
    p.add_argument("--iters", type=int, default=20, help="messages per size and mode")
    p.add_argument("--inflight", type=int, default=8, help="messages in flight (pipelined)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per size/mode (best)")
    p.add_argument("--json", dest="json_out", default=None, help="write rows to this file")
    p.add_argument("--receiver", default=None, help=argparse.SUPPRESS)  # internal: child role
    p.set_defaults(func=run)  # fmt: skip


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("transfer", help="UCX KV transfer throughput vs memcpy")
    add_arguments(p)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench transfer")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
