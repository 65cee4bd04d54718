"""`python -m pdserve.rpc.health_probe HOST:PORT [--timeout S] [--service NAME]`:
exit status 0 when the service answers SERVING, 1 otherwise (docker HEALTHCHECK)."""

from __future__ import annotations

import argparse
import sys

from pdserve.rpc.health import check_health


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.rpc.health_probe")
    parser.add_argument("addr", help="HOST:PORT of the service")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--service", default="", help="gRPC service name ('' = server)")
    args = parser.parse_args(argv)
    ok = check_health(args.addr, args.timeout, args.service)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
