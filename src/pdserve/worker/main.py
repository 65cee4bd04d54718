"""Entry point shared by `python -m pdserve_prefill` and `python -m pdserve_decode`."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from pdserve.config import load_settings
from pdserve.rpc.server import serve
from pdserve.worker.app import WorkerApp
from pdserve.worker.settings import RoleName, WorkerSettings


def main(argv: Sequence[str] | None = None, *, default_role: RoleName, prog: str) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    role_given = "--role" in args or any(a.startswith("--role=") for a in args)
    if not role_given and "PDSERVE_ROLE" not in os.environ:
        args = ["--role", default_role, *args]
    settings = load_settings(WorkerSettings, args, prog=prog)
    return serve(WorkerApp(settings), settings)
