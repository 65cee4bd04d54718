"""UcxTransport between two real processes: per-layer tagged buffers, echo, peer death."""

from __future__ import annotations

import asyncio
import sys
import textwrap

import numpy as np
import pytest

from pdserve.kv.transfer import (
    TransferFailedError,
    TransferTimeoutError,
    UcxTransport,
    make_tag,
)

pytestmark = pytest.mark.integration
pytest.importorskip("ucxx")

LAYERS, LAYER_BYTES = 4, 3 * 16 * 1024 + 8  # odd size on purpose

# The peer: receives LAYERS messages with ticket 1 (posted before the parent sends), echoes
# each back with ticket 2, then waits for a last message that never comes (to be killed).
PEER = textwrap.dedent(
    f"""
    import asyncio, sys
    import numpy as np
    from pdserve.kv.transfer import UcxTransport, make_tag

    async def main():
        t = await UcxTransport.create()
        parent = bytes.fromhex(sys.argv[1])
        bufs = [np.empty({LAYER_BYTES}, np.uint8) for _ in range({LAYERS})]
        handles = [t.post_recv(b, make_tag(1, i)) for i, b in enumerate(bufs)]
        print(t.address.hex(), flush=True)
        for i, h in enumerate(handles):
            await h.wait(60)
            await t.send(parent, make_tag(2, i), bufs[i], timeout_s=30)
        await t.recv(np.empty(8, np.uint8), make_tag(3, 0), timeout_s=600)

    asyncio.run(main())
    """
)


async def read_address(stream: asyncio.StreamReader) -> bytes:
    """The peer's address line (UCX may print log lines on stdout first)."""
    while line := await asyncio.wait_for(stream.readline(), 60):
        try:
            return bytes.fromhex(line.decode().strip())
        except ValueError:
            continue
    raise RuntimeError("peer exited before printing its address")


async def test_layers_echo_between_processes_then_peer_death() -> None:
    t = await UcxTransport.create()
    child = await asyncio.create_subprocess_exec(
        sys.executable, "-c", PEER, t.address.hex(), stdout=asyncio.subprocess.PIPE
    )
    try:
        assert child.stdout is not None
        peer = await read_address(child.stdout)
        rng = np.random.default_rng(1)
        layers = [rng.integers(0, 256, LAYER_BYTES, dtype=np.uint8) for _ in range(LAYERS)]
        echoed = [np.zeros(LAYER_BYTES, np.uint8) for _ in range(LAYERS)]
        handles = [t.post_recv(echoed[i], make_tag(2, i)) for i in range(LAYERS)]
        await asyncio.gather(*(t.send(peer, make_tag(1, i), x) for i, x in enumerate(layers)))
        await asyncio.gather(*(h.wait(30) for h in handles))
        for x, y in zip(layers, echoed, strict=True):
            np.testing.assert_array_equal(x, y)

        # nothing is sent with this tag: the receive must time out, not hang
        with pytest.raises(TransferTimeoutError):
            await t.recv(np.zeros(64, np.uint8), make_tag(9, 0), timeout_s=0.3)

        child.kill()  # kill -9: UCX (error handling off) will not tell us
        await child.wait()
        with pytest.raises(TransferFailedError):  # large: rendezvous never completes
            await t.send(peer, make_tag(3, 0), np.zeros(1 << 20, np.uint8), timeout_s=1.0)
        assert t.num_endpoints == 0  # the failed endpoint was dropped from the pool
        assert t.counters["send_failures"] == 1 and t.counters["recv_timeouts"] == 1
    finally:
        if child.returncode is None:
            child.kill()
            await child.wait()
        await t.close()
