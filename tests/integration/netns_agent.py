"""A client that runs on one host of a network-namespace cluster (tests/integration/
test_multihost.py starts it with `ip netns exec`) and answers the test on stdin/stdout, one
JSON object per line: `{"op": ..., ...}` in, `{"ok": true, "result": ...}` or
`{"ok": false, "error": ...}` out, in order. The test itself stays in the machine's own
namespace, which has no route to the cluster's hosts.

Operations: `status` (one router's instances, request counts and the routers it knows of;
`router` is one address), `metrics` (a /metrics page), `info` (a
worker's Info, as the admin certificate), `kvstats` (the kvstore's Stats), `tls_check` (a
health call verifying the server's certificate against the address dialled, or against
`server_name`), `start` (a batch of streams through one new SDK client, in the background;
`router` lists every router, "a:1,b:2", a stream whose router dies resumes on another, and
`retries` is the client's `max_retries`), `progress` and `wait` (that batch's tokens so far /
when done), `http_completion` (one OpenAI completion on a router's HTTP port).

Run: python netns_agent.py CERT_DIR
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.client.aio import AsyncClient
from pdserve.v1 import kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc


class Agent:
    def __init__(self, cert_dir: Path) -> None:
        self.ca = (cert_dir / "ca.crt").read_bytes()
        self.key = (cert_dir / "admin.key").read_bytes()
        self.cert = (cert_dir / "admin.crt").read_bytes()
        self.batches: dict[str, list[dict[str, Any]]] = {}
        self.tasks: dict[str, list[asyncio.Task]] = {}
        self.closers: set[asyncio.Task] = set()

    def _secure(self, addr: str, server_name: str | None = "pdserve.internal") -> Any:
        creds = grpc.ssl_channel_credentials(self.ca, self.key, self.cert)
        options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
        return grpc.aio.secure_channel(addr, creds, options=options)

    async def status(self, router: str) -> dict:
        async with AsyncClient(router, max_retries=0) as client:
            st = await client.status(timeout=5)
        return {
            "instances": [
                {"id": i.instance_id, "address": i.address, "role": i.role, "state": i.state}
                for i in st.instances
            ],
            "requests_total": st.requests_total,
            "requests_running": st.requests_running,
            "routers": [{"address": r.address, "workers": r.workers} for r in st.routers],
        }

    async def metrics(self, url: str) -> str:
        def get() -> str:
            with urllib.request.urlopen(url, timeout=5) as resp:
                return resp.read().decode()

        return await asyncio.to_thread(get)

    async def info(self, addr: str) -> dict:
        async with self._secure(addr) as channel:
            info = await worker_pb2_grpc.WorkerStub(channel).Info(
                worker_pb2.InfoRequest(), timeout=5
            )
        return {
            "instance_id": info.instance_id,
            "counters": dict(info.counters),
            "load": MessageToDict(info.load, preserving_proto_field_name=True),
        }

    async def kvstats(self, addr: str) -> dict:
        async with self._secure(addr) as channel:
            stats = await kvstore_pb2_grpc.KVStoreStub(channel).Stats(
                kvstore_pb2.StatsRequest(), timeout=5
            )
        return MessageToDict(stats, preserving_proto_field_name=True)

    async def tls_check(self, addr: str, server_name: str | None = None) -> dict:
        """Health.Check over mutual TLS, the server verified against `server_name` or, with
        none, against the address dialled (its certificate must name it)."""
        try:
            async with self._secure(addr, server_name) as channel:
                await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
        except grpc.RpcError as exc:
            return {"ok": False, "error": f"{exc.code().name}: {exc.details()}"}
        return {"ok": True, "error": ""}

    async def start(
        self, batch: str, router: str, requests: list[dict], stream_s: float, retries: int = 0
    ) -> int:
        streams: list[dict[str, Any]] = [
            {"token_ids": [], "error": None, "finish_reason": None, "decode_instance": None,
             "max_gap_s": 0.0, "first_s": None}
            for _ in requests
        ]  # fmt: skip
        self.batches[batch] = streams
        client = AsyncClient(router, timeout=stream_s, max_retries=retries)

        async def run(i: int, req: dict) -> None:
            out = streams[i]
            started = last = time.monotonic()
            try:
                async for ev in client.generate_stream(**req):
                    now = time.monotonic()  # the longest wait between two messages
                    out["max_gap_s"], last = max(out["max_gap_s"], now - last), now
                    if out["first_s"] is None:  # the wait for the first message
                        out["first_s"] = now - started
                    out["token_ids"].extend(ev.token_ids)
                    if ev.finish_reason:
                        out["finish_reason"] = ev.finish_reason
                    if ev.usage is not None:
                        out["decode_instance"] = ev.usage.decode_instance
            except Exception as exc:
                out["error"] = f"{type(exc).__name__}: {exc}"
            out["elapsed_s"] = time.monotonic() - started

        tasks = [asyncio.ensure_future(run(i, r)) for i, r in enumerate(requests)]
        self.tasks[batch] = tasks

        async def close_when_done() -> None:
            await asyncio.gather(*tasks)
            await client.close()

        self.closers.add(asyncio.ensure_future(close_when_done()))
        return len(tasks)

    async def http_completion(self, url: str, prompt: list[int], max_tokens: int) -> dict:
        """POST {url}/v1/completions, greedy, the model as /v1/models names it, the token ids
        returned: the status and the body."""

        def post() -> dict:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
                model = json.loads(resp.read())["data"][0]["id"]
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "ignore_eos": True, "temperature": 0.0, "return_token_ids": True}  # fmt: skip
            req = urllib.request.Request(
                f"{url}/v1/completions", json.dumps(body).encode(),
                {"content-type": "application/json"},
            )  # fmt: skip
            try:
                with urllib.request.urlopen(req, timeout=30) as resp:
                    return {"status": resp.status, "body": json.loads(resp.read())}
            except urllib.error.HTTPError as exc:
                return {"status": exc.code, "body": exc.read().decode(errors="replace")}

        return await asyncio.to_thread(post)

    async def progress(self, batch: str) -> dict:
        return {
            "tokens": [len(s["token_ids"]) for s in self.batches[batch]],
            "done": sum(t.done() for t in self.tasks[batch]),
        }

    async def wait(self, batch: str, wait_s: float) -> list[dict]:
        await asyncio.wait(self.tasks[batch], timeout=wait_s)
        for s, t in zip(self.batches[batch], self.tasks[batch], strict=True):
            if not t.done():
                s["error"] = s["error"] or f"still running after {wait_s} s"
        return self.batches.pop(batch)


async def main() -> None:
    agent = Agent(Path(sys.argv[1]))
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        msg = json.loads(line)
        op = msg.pop("op")
        try:
            reply = {"ok": True, "result": await getattr(agent, op)(**msg)}
        except Exception as exc:
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    asyncio.run(main())
