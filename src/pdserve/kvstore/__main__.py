"""`python -m pdserve.kvstore` / `pdserve-kvstore`."""

from __future__ import annotations

import sys

from pdserve.config import load_settings
from pdserve.kvstore.app import KVStoreApp
from pdserve.kvstore.settings import KVStoreSettings
from pdserve.rpc.server import serve


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    settings = load_settings(KVStoreSettings, args, prog="pdserve-kvstore")
    return serve(KVStoreApp(settings), settings)


if __name__ == "__main__":
    sys.exit(main())
