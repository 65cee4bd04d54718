"""Worker entry point: `python -m pdserve.worker --role prefill|decode|colocated`.

Prefill and decode run the same worker: a role is state the router may flip, so every worker can
play every role. `--role` (or `PDSERVE_ROLE`) is the one way to choose the starting role.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from pdserve.config import load_settings
from pdserve.rpc.server import serve
from pdserve.worker.app import WorkerApp
from pdserve.worker.settings import WorkerSettings


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    settings = load_settings(WorkerSettings, args, prog="pdserve-worker")
    return serve(WorkerApp(settings), settings)
