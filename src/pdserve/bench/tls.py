"""`pdserve bench tls`: what mutual TLS costs one internal gRPC call, against plaintext, in
the same process and run (alternating rounds, so machine load hits both arms alike).

Two shapes of call, the ones on a request's path:
- unary: a Prefill-sized request and a small reply (the router's Prefill/Register/Heartbeat);
- stream: a Decode-like server stream of N TokenChunk messages of one token each (the cost
  per streamed token is what adds to TPOT).

KV bytes never cross gRPC (they go over UCX), so this is the whole of TLS's cost.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from typing import Any

from grpc import aio

from pdserve.rpc.certs import make_dev_pki
from pdserve.rpc.tls import TlsFiles, secure_channel
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc


class _Worker(worker_pb2_grpc.WorkerServicer):
    async def Prefill(self, request, context):
        return worker_pb2.PrefillResponse(first_token_id=1)

    async def Decode(self, request, context):
        for i in range(request.sampling.max_tokens):
            yield worker_pb2.TokenChunk(token_ids=[i % 1000])


async def _arm(addr: str, files: TlsFiles | None, calls: int, chunks: int) -> dict[str, float]:
    channel = secure_channel(addr, files) if files else aio.insecure_channel(addr)
    async with channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        req = worker_pb2.PrefillRequest(
            request_id="bench",
            token_ids=list(range(128)),
            ticket=worker_pb2.Ticket(ticket_id=1 << 16, ucx_worker_address=b"x" * 300),
        )
        await stub.Prefill(req)  # connect (the handshake is paid once per channel)
        t0, c0 = time.perf_counter(), time.process_time()
        for _ in range(calls):
            await stub.Prefill(req)
        unary_us = (time.perf_counter() - t0) / calls * 1e6
        unary_cpu_us = (time.process_time() - c0) / calls * 1e6
        dreq = worker_pb2.DecodeRequest(
            request_id="bench", sampling=common_pb2.SamplingParams(max_tokens=chunks)
        )
        t0, c0 = time.perf_counter(), time.process_time()
        n = 0
        async for _chunk in stub.Decode(dreq):
            n += 1
        per_chunk_us = (time.perf_counter() - t0) / max(n, 1) * 1e6
        per_chunk_cpu_us = (time.process_time() - c0) / max(n, 1) * 1e6
    return {
        "unary_us": unary_us,
        "per_chunk_us": per_chunk_us,
        "unary_cpu_us": unary_cpu_us,
        "per_chunk_cpu_us": per_chunk_cpu_us,
    }


async def run(calls: int, chunks: int, rounds: int) -> dict[str, Any]:
    certs = tempfile.mkdtemp(prefix="pdserve-bench-tls-")
    make_dev_pki(certs, [("worker", "worker"), ("router", "router")])
    server_files, client_files = TlsFiles.in_dir(certs, "worker"), TlsFiles.in_dir(certs, "router")
    server = aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(_Worker(), server)
    plain_port = server.add_insecure_port("127.0.0.1:0")
    tls_port = server.add_secure_port("127.0.0.1:0", server_files.server_credentials())
    await server.start()
    results: dict[str, list[dict[str, float]]] = {"plaintext": [], "mtls": []}
    try:
        for _ in range(rounds):
            results["plaintext"].append(await _arm(f"127.0.0.1:{plain_port}", None, calls, chunks))
            results["mtls"].append(await _arm(f"127.0.0.1:{tls_port}", client_files, calls, chunks))
    finally:
        await server.stop(0)
    out: dict[str, Any] = {"calls": calls, "chunks": chunks, "rounds": rounds}
    keys = ("unary_us", "per_chunk_us", "unary_cpu_us", "per_chunk_cpu_us")
    for arm, rows in results.items():
        for key in keys:
            out[f"{arm}_{key}_median"] = statistics.median(r[key] for r in rows)
    for key in keys:
        out[f"mtls_extra_{key}"] = out[f"mtls_{key}_median"] - out[f"plaintext_{key}_median"]
    return out


def main(args: argparse.Namespace) -> int:
    res = asyncio.run(run(args.calls, args.chunks, args.rounds))
    print("medians of", args.rounds, "alternating rounds; wall = latency, cpu = process time")
    print(f"{'':10s} {'unary wall':>12s} {'unary cpu':>10s} {'chunk wall':>11s} {'chunk cpu':>10s}")
    for arm in ("plaintext", "mtls"):
        print(
            f"{arm:10s} {res[f'{arm}_unary_us_median']:10.1f}us "
            f"{res[f'{arm}_unary_cpu_us_median']:8.1f}us "
            f"{res[f'{arm}_per_chunk_us_median']:9.1f}us "
            f"{res[f'{arm}_per_chunk_cpu_us_median']:8.1f}us"
        )
    print(
        f"mTLS extra per unary call: {res['mtls_extra_unary_us']:+.1f} us wall, "
        f"{res['mtls_extra_unary_cpu_us']:+.1f} us cpu; per streamed token: "
        f"{res['mtls_extra_per_chunk_us']:+.1f} us wall, "
        f"{res['mtls_extra_per_chunk_cpu_us']:+.1f} us cpu"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2)
    return 0


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("tls", help="mutual TLS vs plaintext cost of internal gRPC calls")
    p.add_argument("--calls", type=int, default=500, help="unary calls per round")
    p.add_argument("--chunks", type=int, default=2000, help="streamed chunks per round")
    p.add_argument("--rounds", type=int, default=7, help="alternating rounds per arm")
    p.add_argument("--out", help="JSON result path")
    p.set_defaults(func=main)
