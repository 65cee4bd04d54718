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

# short flags of the emulated engine (`model_config` is a reserved name in pydantic settings)
ALIASES = {"--model-config": "--emulate-model-config", "--profile": "--emulate-profile"}


def _aliased(args: list[str]) -> list[str]:
    out = []
    for a in args:
        flag, eq, value = a.partition("=")
        out.append(ALIASES.get(flag, flag) + eq + value)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _aliased(list(sys.argv[1:] if argv is None else argv))
    settings = load_settings(WorkerSettings, args, prog="pdserve-worker")
    return serve(WorkerApp(settings), settings)
