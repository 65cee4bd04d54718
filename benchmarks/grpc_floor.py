"""The floor under the router's costs: what grpc.aio itself costs a Python server per call and
per streamed message, before any pdserve code runs.

A server process answers `pdserve.v1.Router/Generate` (the router's public call, same
messages) with a handler that does nothing but write `--messages` responses of one token
each (`context.write`, as the router does); this process drives it with `--concurrency`
closed-loop callers for `--duration` s and reads the server's CPU time (/proc) over the run.
Arms, alternated `--repeats` times in one run: `bare`, the server alone; `chain`, the same
with pdserve's interceptor chain of the public plane (request id, metrics, error mapping);
`relay`, the bare server relaying each call through one `Worker.Streams` call to a backend
process that answers every stream at once (the least a router with a worker hop does per
request: its public call, a stream opened and its event read over one multiplexed call,
batched both ways; no pdserve code). The router cannot cost less per request than these.

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

messages, chain, relay = int(sys.argv[1]), sys.argv[2] == "chain", sys.argv[2] == "relay"
backend = sys.argv[3] if relay else ""

async def generate(request, context):
    if relay:
        await RELAY.ask(request.request_id)
    for i in range(messages):
        await context.write(router_pb2.GenerateResponse(request_id=request.request_id,
                                                        token_ids=[i], text="x"))

class Relay:
    # one Streams call to the backend: opens batched by one writer, events by one reader
    def __init__(self, addr):
        from pdserve.v1 import worker_pb2, worker_pb2_grpc
        self.pb = worker_pb2
        self.call = worker_pb2_grpc.WorkerStub(aio.insecure_channel(addr)).Streams()
        self.waiting, self.opens, self.next, self.wake = {}, [], 0, None
        asyncio.ensure_future(self.write()); asyncio.ensure_future(self.read())
    async def ask(self, rid):
        self.next += 1
        fut = self.waiting[self.next] = asyncio.get_running_loop().create_future()
        self.opens.append(self.pb.StreamOpen(stream_id=self.next,
                          generate=self.pb.WorkerGenerateRequest(request_id=rid, token_ids=[1])))
        if self.wake is not None and not self.wake.done():
            self.wake.set_result(None)
        await fut
    async def write(self):
        while True:
            if not self.opens:
                self.wake = asyncio.get_running_loop().create_future()
                await self.wake
                continue
            msg, self.opens = self.pb.StreamsRequest(open=self.opens), []
            await self.call.write(msg)
    async def read(self):
        while True:
            msg = await self.call.read()
            for ev in msg.events:
                self.waiting.pop(ev.stream_id).set_result(None)

async def main():
    global RELAY
    if relay:
        RELAY = Relay(backend)
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

# The backend of the `relay` arm: answers every opened stream with one event, batched.
BACKEND = r"""
import asyncio, sys
import grpc
from grpc import aio
from pdserve.v1 import worker_pb2, worker_pb2_grpc

class Backend(worker_pb2_grpc.WorkerServicer):
    async def Streams(self, request_iterator, context):
        async for req in request_iterator:
            out = worker_pb2.StreamsEvents()
            for o in req.open:
                out.events.add(stream_id=o.stream_id, token_ids=[7], finish_reason=2)
            if out.events:
                await context.write(out)

async def main():
    server = aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(Backend(), server)
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
    backend = None
    argv = [sys.executable, "-c", SERVER, str(messages), arm]
    if arm == "relay":
        backend = subprocess.Popen(
            [sys.executable, "-c", BACKEND], stdout=subprocess.PIPE, text=True
        )
        argv.append(f"127.0.0.1:{int(backend.stdout.readline())}")
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())
        asyncio.run(drive(port, args.concurrency, 1.0))  # warm-up
        c0, t0 = cpu_s(proc.pid), time.monotonic()
        calls, msgs = asyncio.run(drive(port, args.concurrency, args.duration))
        cpu, wall = cpu_s(proc.pid) - c0, time.monotonic() - t0
    finally:
        proc.kill()
        proc.wait()
        if backend is not None:
            backend.kill()
            backend.wait()
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
        arms = ["bare", "chain", "relay"] if rep % 2 == 0 else ["relay", "chain", "bare"]
        for arm in arms:
            kinds = (
                [("call", 1)] if arm == "relay" else [("call", 1), ("stream", args.stream_messages)]
            )
            for kind, n in kinds:
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
