"""`python -m pdserve.router` / `pdserve-router`."""

from __future__ import annotations

import sys

from pdserve.config import load_settings
from pdserve.rpc.server import serve

from .app import RouterApp
from .settings import RouterSettings


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(
        RouterSettings, sys.argv[1:] if argv is None else argv, prog="pdserve-router"
    )
    return serve(RouterApp(settings), settings)  # logging, uvloop, lifecycle, exit status


if __name__ == "__main__":
    sys.exit(main())
