"""`pdserve kvstore stats|purge-writer`: operator calls to a kvstore's internal port, with an
admin certificate (mutual TLS; see docs/SECURITY.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("kvstore", help="operator calls to the kvstore (admin cert)")
    sub = p.add_subparsers(dest="kvstore_command", required=True)
    for name, helptext in (
        ("stats", "print the store's counters as JSON"),
        ("purge-writer", "drop every block a writer put (and the blocks chained after them)"),
    ):
        q = sub.add_parser(name, help=helptext)
        q.add_argument("--addr", required=True, help="HOST:PORT of the kvstore")
        q.add_argument(
            "--tls-dir",
            default=os.environ.get("PDSERVE_TLS_DIR"),
            help="certificates dir (env PDSERVE_TLS_DIR); none = plaintext (--insecure store)",
        )
        q.add_argument("--tls-name", default="admin", help="certificate to present")
        q.add_argument("--timeout", type=float, default=10.0)
        if name == "purge-writer":
            q.add_argument("writer", help="identity URI, e.g. spiffe://pdserve/worker/prefill0")
        q.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.rpc.tls import TlsFiles, secure_channel_sync
    from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc

    channel = (
        secure_channel_sync(args.addr, TlsFiles.in_dir(args.tls_dir, args.tls_name))
        if args.tls_dir
        else grpc.insecure_channel(args.addr)
    )
    try:
        with channel:
            stub = kvstore_pb2_grpc.KVStoreStub(channel)
            if args.kvstore_command == "stats":
                s = stub.Stats(kvstore_pb2.StatsRequest(), timeout=args.timeout)
                out = {f.name: v for f, v in s.ListFields()}
            else:
                r = stub.PurgeWriter(
                    kvstore_pb2.PurgeWriterRequest(writer=args.writer), timeout=args.timeout
                )
                out = {"removed_blocks": r.num_blocks, "in_use_blocks": r.num_in_use}
    except grpc.RpcError as exc:
        print(f"pdserve kvstore: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    print(json.dumps(out))
    return 0
