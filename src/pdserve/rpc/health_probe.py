"""`python -m pdserve.rpc.health_probe HOST:PORT [--timeout S] [--service NAME]
[--tls-dir DIR] [--tls-name NAME] [--plaintext]`: exit status 0 when the service answers
SERVING, 1 otherwise (docker HEALTHCHECK).

Internal listeners demand a client certificate: with --tls-dir (default: env
PDSERVE_TLS_DIR) the probe presents DIR/<tls-name>.crt (default: env PDSERVE_TLS_NAME, else
admin). --plaintext probes a public port (the router's client API)."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.rpc.health import check_health


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.rpc.health_probe")
    parser.add_argument("addr", help="HOST:PORT of the service")
    parser.add_argument("--timeout", type=float, default=2.0, help="seconds (default 2)")
    parser.add_argument("--service", default="", help="gRPC service name ('' = server)")
    parser.add_argument("--tls-dir", default=os.environ.get("PDSERVE_TLS_DIR"))
    parser.add_argument("--tls-name", default=os.environ.get("PDSERVE_TLS_NAME") or "admin")
    parser.add_argument("--plaintext", action="store_true", help="no TLS (a public port)")
    args = parser.parse_args(argv)
    tls = None
    if args.tls_dir and not args.plaintext:
        from pdserve.rpc.tls import TlsFiles

        tls = TlsFiles.in_dir(args.tls_dir, args.tls_name)
    ok = check_health(args.addr, args.timeout, args.service, tls=tls)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
