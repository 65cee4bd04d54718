"""The machine-readable line a service prints on stdout once it is SERVING:

    PDSERVE_READY {"host": "127.0.0.1", "instance_id": "...", "pid": 123, "port": 50051,
                   "service": "router"}

The launcher (`pdserve up`) and the tests wait for it. Torch- and grpc-free.
"""

from __future__ import annotations

import json
from typing import Any

READY_PREFIX = "PDSERVE_READY"


def format_ready_line(info: dict[str, Any]) -> str:
    return f"{READY_PREFIX} {json.dumps(info, sort_keys=True)}"


def parse_ready_line(line: str) -> dict[str, Any] | None:
    """The JSON of a `PDSERVE_READY {...}` line, or None for any other line."""
    line = line.strip()
    if not line.startswith(READY_PREFIX + " "):
        return None
    try:
        info = json.loads(line[len(READY_PREFIX) + 1 :])
    except json.JSONDecodeError:
        return None
    return info if isinstance(info, dict) else None
