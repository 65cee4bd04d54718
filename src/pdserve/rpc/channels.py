"""Client side: grpc.aio channels with one set of options, request-id metadata, a pool.

Bulk KV never travels over gRPC (it goes over UCX), so message limits only need room for long
token lists and status pages.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from grpc import aio

from pdserve.logging import request_id_var
from pdserve.rpc.interceptor import REQUEST_ID_KEY
from pdserve.rpc.tls import TARGET_NAME_OPTION, client_credentials

MAX_MESSAGE_BYTES = 64 * 1024 * 1024

# Keepalive: ping an idle connection every 30 s, drop it if the ping is not answered in 10 s,
# so a dead peer shows up as UNAVAILABLE instead of a hang. SERVER_OPTIONS must allow it.
CHANNEL_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.enable_retries", 1),
    ("grpc.primary_user_agent", "pdserve"),
)

# A call that reached a server waits in grpc's core until the event loop accepts it (the aio
# server asks for one call at a time). Under a burst (2,048 streams at once on one router)
# the core, with its defaults, drops waiting calls before any handler runs: it refuses some
# once more than 1,000 wait (random early drop up to 3,000) and kills those that waited
# 30 s. Their client gets CANCELLED and the service never sees them, so it can neither log
# nor count them. With these limits such calls wait for the loop and reach the service,
# whose own admission queues them or answers RESOURCE_EXHAUSTED; the client's deadline
# still bounds the wait.
PENDING_CALLS_MAX = 1 << 16
PENDING_CALL_WAIT_S = 3600

SERVER_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.server.max_pending_requests", PENDING_CALLS_MAX),
    ("grpc.server.max_pending_requests_hard_limit", PENDING_CALLS_MAX),
    ("grpc.server_max_unrequested_time_in_server", PENDING_CALL_WAIT_S),
    # A port already in use must fail loudly, not be shared with another process.
    ("grpc.so_reuseport", 0),
)


def make_channel(
    addr: str, *, options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] = ()
) -> aio.Channel:
    """A grpc.aio channel to an internal service at HOST:PORT with CHANNEL_OPTIONS
    (`options` override entries of the same name): mutual TLS with the process's
    certificate once the service runner configured it (pdserve.rpc.tls.configure_client),
    plaintext otherwise (--insecure, tests of one component). Create it inside the event
    loop that will use it."""
    merged = dict(CHANNEL_OPTIONS)
    merged.update(dict(options))
    creds = client_credentials()
    if creds is not None:
        merged.setdefault(TARGET_NAME_OPTION[0], TARGET_NAME_OPTION[1])
        return aio.secure_channel(
            addr, creds, options=list(merged.items()), interceptors=list(interceptors) or None
        )
    return aio.insecure_channel(
        addr, options=list(merged.items()), interceptors=list(interceptors) or None
    )


def metadata_with_request_id(
    request_id: str | None = None, extra: Sequence[tuple[str, str]] = ()
) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `x-request-id`; request_id=None uses the current task's id
    (so a service forwards the id of the call it is serving). No id -> only `extra`."""
    rid = request_id if request_id is not None else request_id_var.get()
    items = list(extra)
    if rid:
        items.append((REQUEST_ID_KEY, rid))
    return tuple(items)


class ChannelPool:
    """addr -> one shared channel. Use from one event loop; `close()` on shutdown.

    grpc channels multiplex calls and reconnect by themselves, so one channel per peer is
    enough; `discard(addr)` drops a peer that left (e.g. deregistered worker)."""

    def __init__(self, options: Sequence[tuple[str, Any]] = ()) -> None:
        self._options = tuple(options)
        self._channels: dict[str, aio.Channel] = {}
        self._closed = False

    def get(self, addr: str) -> aio.Channel:
        if self._closed:
            raise RuntimeError("ChannelPool is closed")
        channel = self._channels.get(addr)
        if channel is None:
            channel = make_channel(addr, options=self._options)
            self._channels[addr] = channel
        return channel

    def __contains__(self, addr: object) -> bool:
        return addr in self._channels

    def __len__(self) -> int:
        return len(self._channels)

    async def discard(self, addr: str, grace: float | None = None) -> None:
        channel = self._channels.pop(addr, None)
        if channel is not None:
            await channel.close(grace)

    async def close(self, grace: float | None = None) -> None:
        self._closed = True
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close(grace)

    async def __aenter__(self) -> ChannelPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def wait_ready(channel: aio.Channel, timeout: float) -> bool:
    """True once the channel connects within `timeout` seconds, False otherwise."""
    try:
        await asyncio.wait_for(channel.channel_ready(), timeout)
    except asyncio.TimeoutError:
        return False
    return True
