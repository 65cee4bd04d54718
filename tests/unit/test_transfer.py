"""UcxTransport in one process (loopback to its own worker) + tags and byte views."""

from __future__ import annotations

import asyncio
import contextlib

import numpy as np
import pytest

from pdserve.kv.transfer import (
    TransferFailedError,
    TransferTimeoutError,
    UcxTransport,
    as_bytes,
    make_tag,
    tag_base,
)

pytest.importorskip("ucxx")


def test_tags_are_distinct_per_ticket_and_layer() -> None:
    tags = {make_tag(t, layer) for t in (1, 2, 3, 2**47) for layer in (0, 1, 255, 65535)}
    assert len(tags) == 16
    assert all(0 <= t < 2**64 for t in tags)
    assert make_tag(7, 3) == tag_base(7) + 3
    with pytest.raises(ValueError):
        make_tag(1, 1 << 16)


def test_as_bytes_is_a_view() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    v = as_bytes(a, writable=True)
    assert v.dtype == np.uint8 and v.nbytes == a.nbytes
    v[:4] = 0
    assert a[0, 0] == 0.0
    with pytest.raises(ValueError):
        as_bytes(a[:, ::2])
    with pytest.raises(ValueError):
        as_bytes(b"abc", writable=True)


def test_as_bytes_torch_bfloat16_view() -> None:
    torch = pytest.importorskip("torch")
    t = torch.arange(8, dtype=torch.bfloat16).reshape(2, 4)
    v = as_bytes(t, writable=True)
    assert v.nbytes == 16
    v[:] = as_bytes(torch.full((2, 4), 3.0, dtype=torch.bfloat16))
    assert torch.equal(t, torch.full((2, 4), 3.0, dtype=torch.bfloat16))


async def test_loopback_tagged_layers_and_counters() -> None:
    t = await UcxTransport.create()
    try:
        ticket = t.new_ticket()
        rng = np.random.default_rng(0)
        layers = [rng.integers(0, 255, size=4096 * (i + 1), dtype=np.uint8) for i in range(4)]
        outs = [np.zeros_like(x) for x in layers]
        # receives posted first, in reverse order: tags, not order, decide where bytes land
        handles = [t.post_recv(outs[i], make_tag(ticket, i)) for i in reversed(range(4))]
        await asyncio.gather(
            *(t.send(t.address, make_tag(ticket, i), x) for i, x in enumerate(layers))
        )
        await asyncio.gather(*(h.wait(5.0) for h in handles))
        for x, y in zip(layers, outs, strict=True):
            np.testing.assert_array_equal(x, y)
        total = sum(x.nbytes for x in layers)
        assert t.counters["bytes_sent"] == total
        assert t.counters["bytes_received"] == total
        assert t.counters["transfers_received"] == 4
        assert t.num_endpoints == 1  # pooled: one endpoint for four sends
    finally:
        await t.close()


async def test_a_receive_counts_once_however_often_it_is_awaited() -> None:
    """Counted when it arrives: waiting twice (the pump, then a release) does not count it
    twice, and one that arrives with nobody waiting still counts; a retired receive (matched
    by our own empty message) does not."""
    t = await UcxTransport.create()
    try:
        ticket = t.new_ticket()
        x, y = np.arange(4096, dtype=np.uint8), np.arange(1000, dtype=np.uint8)
        waited, unwaited = np.zeros_like(x), np.zeros_like(y)
        h1 = t.post_recv(waited, make_tag(ticket, 0))
        h2 = t.post_recv(unwaited, make_tag(ticket, 1))
        h3 = t.post_recv(np.zeros_like(x), make_tag(ticket, 2))
        await t.send(t.address, make_tag(ticket, 0), x)
        await t.send(t.address, make_tag(ticket, 1), y)
        await h1.wait(5.0)
        await h1.wait(0)
        async with asyncio.timeout(5.0):
            while not h2.done:  # noqa: ASYNC110 (polls a UCX receive)
                await asyncio.sleep(0.001)
        await h3.cancel()
        await asyncio.sleep(0)  # done callbacks run
        assert t.counters["bytes_received"] == x.nbytes + y.nbytes
        assert t.counters["transfers_received"] == 2
        np.testing.assert_array_equal(unwaited, y)
    finally:
        await t.close()


async def test_recv_timeout_retires_the_receive() -> None:
    t = await UcxTransport.create()
    try:
        buf = np.zeros(1 << 16, np.uint8)
        tag = t.new_tag_base()
        with pytest.raises(TransferTimeoutError):
            await t.recv(buf, tag, timeout_s=0.2)
        assert t.counters["recv_timeouts"] == 1
        # a late message with the retired tag must not land in the caller's buffer (a large
        # one stays unmatched, so its send times out: the sender sees a failure, not a hang)
        with contextlib.suppress(TransferFailedError):
            await t.send(t.address, tag, np.full(1 << 16, 7, np.uint8), timeout_s=0.5)
        await asyncio.sleep(0.2)
        assert not buf.any()
        # cancel() of a posted receive is idempotent and completes the handle
        h = t.post_recv(buf, t.new_tag_base())
        await h.cancel()
        await h.cancel()
        assert h.done
    finally:
        await t.close()


async def test_send_to_unreachable_peer_fails_fast() -> None:
    t = await UcxTransport.create()
    try:
        with pytest.raises(TransferFailedError):
            await t.send(b"not a ucx address", 1, np.zeros(8, np.uint8), timeout_s=1.0)
        assert t.counters["send_failures"] == 1
    finally:
        await t.close()
    with pytest.raises(TransferFailedError):
        await t.send(b"x", 1, np.zeros(8, np.uint8))
