"""`pdserve certs make DIR`: a development CA and per-service certificates for the internal
plane's mutual TLS (see docs/SECURITY.md)."""

from __future__ import annotations

import argparse
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("certs", help="development certificates for the internal plane")
    sub = p.add_subparsers(dest="certs_command", required=True)
    make = sub.add_parser(
        "make",
        help="create a CA (or reuse DIR/ca.*) and one certificate per service",
        description="Write DIR/ca.crt, DIR/ca.key and DIR/<name>.crt/.key for every service. "
        "Each certificate names its role in a SAN URI spiffe://pdserve/<role>/<name>. "
        "Default set: router, kvstore, worker (shared by every worker), admin.",
    )
    make.add_argument("dir", help="output directory (created if missing)")
    make.add_argument(
        "--service",
        action="append",
        default=[],
        metavar="ROLE:NAME[@HOST,...]",
        help="a certificate to make instead of the default set, e.g. worker:prefill0, or "
        "worker:prefill0@10.77.0.10 to also name the address (or DNS name) of the host it "
        "serves on (repeatable; roles: router, worker, kvstore, admin)",
    )
    make.add_argument(
        "--san",
        action="append",
        default=[],
        metavar="HOST",
        help="an IP address or DNS name every certificate made here also names (repeatable)",
    )
    make.add_argument(
        "--workers", type=int, default=0, help="also make worker-0 .. worker-N-1 (own identities)"
    )
    make.set_defaults(func=run_make)


def run_make(args: argparse.Namespace) -> int:
    from pdserve.rpc.certs import DEFAULT_SERVICES, make_dev_pki

    services: list[tuple[str, str]] = []
    hosts: dict[str, list[str]] = {}
    for spec in args.service:
        role, sep, rest = spec.partition(":")
        name, at, addrs = rest.partition("@")
        if not sep or (at and not addrs):
            print(
                f"pdserve certs: --service wants ROLE:NAME[@HOST,...], got {spec!r}",
                file=sys.stderr,
            )
            return 2
        services.append((role, name))
        hosts.setdefault(name, []).extend(a.strip() for a in addrs.split(",") if a.strip())
    if not services:
        services = list(DEFAULT_SERVICES)
    services += [("worker", f"worker-{i}") for i in range(max(0, args.workers))]
    try:
        made = make_dev_pki(args.dir, services, hosts, args.san)
    except ValueError as exc:
        print(f"pdserve certs: {exc}", file=sys.stderr)
        return 2
    for ident in made:
        named = [*hosts.get(ident.name, ()), *args.san]
        extra = f"  ({', '.join(dict.fromkeys(named))})" if named else ""
        print(f"{args.dir}/{ident.name}.crt  {ident.uri}{extra}")
    print(f"{args.dir}/ca.crt  (cluster CA; keep {args.dir}/ca.key private)")
    return 0
