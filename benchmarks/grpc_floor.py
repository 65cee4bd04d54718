"""The floor under the router's costs: what grpc.aio itself costs a Python server per call and
per streamed message, before any pdserve code runs.

A server process answers `pdserve.v1.Router/Generate` (the router's public call, same
messages) with a handler that does nothing but write `--messages` responses of one token
each (`context.write`, as the router does); this process drives it with `--concurrency`
closed-loop callers for `--duration` s and reads the server's CPU time (/proc) over the run.
Two arms, alternated `--repeats` times in one run: the bare server, and the same server with
pdserve's interceptor chain of the public plane (request id, metrics, error mapping). The
router cannot cost less per request than the first column, nor per streamed message than
the second.

    .venv/bin/python -m benchmarks.grpc_floor --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time

SERVER = r"""
import asyncio, sys
import grpc
from grpc import aio
from pdserve.v1 import router_pb2

messages, chain = int(sys.argv[1]), sys.argv[2] == "chain"

async def generate(request, context):
    for i in range(messages):
        await context.write(router_pb2.GenerateResponse(request_id=request.request_id,
                                                        token_ids=[i], text="x"))

async def main():
    interceptors = []
    if chain:
        from pdserve.rpc.interceptor import server_interceptors
        from pdserve.rpc.metrics import Metrics, MetricsInterceptor
        interceptors = server_interceptors(MetricsInterceptor(Metrics()))
    server = aio.server(interceptors=interceptors)
    handler = grpc.method_handlers_generic_handler("pdserve.v1.Router", {
        "Generate": grpc.unary_stream_rpc_method_handler(
            generate, request_deserializer=router_pb2.GenerateRequest.FromString,
            response_serializer=router_pb2.GenerateResponse.SerializeToString)})
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()

import uvloop
uvloop.run(main())
"""


def cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100.0


async def drive(port: int, concurrency: int, duration: float) -> tuple[int, int]:
    import grpc

    from pdserve.v1 import router_pb2, router_pb2_grpc

    calls = msgs = 0
    stop = time.monotonic() + duration
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def loop(k: int) -> None:
            nonlocal calls, msgs
            req = router_pb2.GenerateRequest(request_id=f"r{k}")
            req.token_ids.ids.extend(range(8))
            while time.monotonic() < stop:
                async for _ in stub.Generate(req, metadata=(("x-request-id", f"r{k}"),)):
                    msgs += 1
                calls += 1

        await asyncio.gather(*(loop(k) for k in range(concurrency)))
    return calls, msgs


def measure(arm: str, messages: int, args: argparse.Namespace) -> dict[str, float]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(messages), arm], stdout=subprocess.PIPE, text=True
    )
    try:
        port = int(proc.stdout.readline())
        asyncio.run(drive(port, args.concurrency, 1.0))  # warm-up
        c0, t0 = cpu_s(proc.pid), time.monotonic()
        calls, msgs = asyncio.run(drive(port, args.concurrency, args.duration))
        cpu, wall = cpu_s(proc.pid) - c0, time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
    return {"calls": calls, "messages": msgs, "server_cpu_s": cpu, "wall_s": wall,
            "us_per_call": 1e6 * cpu / max(calls, 1), "us_per_message": 1e6 * cpu / max(msgs, 1)}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grpc_floor")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--duration", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream-messages", type=int, default=64, help="messages per streamed call")
    p.add_argument("--out", help="write the samples as JSON")
    args = p.parse_args()
    print(" ".join(sys.argv))
    samples: dict[str, list[dict[str, float]]] = {}
    for rep in range(args.repeats):
        arms = ["bare", "chain"] if rep % 2 == 0 else ["chain", "bare"]
        for arm in arms:
            for kind, n in (("call", 1), ("stream", args.stream_messages)):
                s = measure(arm, n, args)
                samples.setdefault(f"{arm}/{kind}", []).append(s)
                print(f"  {arm:<6} {kind:<7} {json.dumps(s)}", flush=True)
    for key, ss in samples.items():
        arm, kind = key.split("/")
        if kind == "call":
            xs = [s["us_per_call"] for s in ss]
            print(f"{arm:<6} server CPU per call (1 message):   {statistics.fmean(xs):7.1f} us")
        else:
            # per message beyond the call's own cost: (stream call - 1-message call) / (n - 1)
            per_call = statistics.fmean(s["us_per_call"] for s in samples[f"{arm}/call"])
            xs = [(s["us_per_call"] - per_call) / (args.stream_messages - 1) for s in ss]
            print(f"{arm:<6} server CPU per further message:    {statistics.fmean(xs):7.1f} us")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"argv": sys.argv, "samples": samples}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
