"""`python -m pdserve_router` / `pdserve-router`."""

from __future__ import annotations

import asyncio
import sys

from pdserve.config import load_settings
from pdserve.logging import configure_logging
from pdserve.rpc.server import install_event_loop, run_service

from .app import RouterApp
from .settings import RouterSettings


def main(argv: list[str] | None = None) -> int:
    settings = load_settings(RouterSettings, sys.argv[1:] if argv is None else argv,
                             prog="pdserve-router")
    configure_logging(fmt=settings.log_format, level=settings.log_level, service="router")
    install_event_loop()
    asyncio.run(run_service(RouterApp(settings), settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
