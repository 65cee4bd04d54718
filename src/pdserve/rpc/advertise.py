"""The address a service tells others to dial (workers register it; routers report it)."""

from __future__ import annotations

import socket


def advertised_address(host: str, port: int, advertise_host: str | None) -> str:
    """Explicit `advertise_host`, else the bind host, else this host's IP (a wildcard bind,
    e.g. in a container)."""
    if advertise_host:
        return f"{advertise_host}:{port}"
    if host not in ("0.0.0.0", "::", ""):
        return f"{host}:{port}"
    try:
        return f"{socket.gethostbyname(socket.gethostname())}:{port}"
    except OSError:
        return f"127.0.0.1:{port}"
