"""Test doubles for the router tests (a helper module, not collected): a model directory with a
real byte-level BPE tokenizer but no weights, the router as a real process, and
fake Worker servicers with deterministic tokens that log every call."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pdserve.router.cluster.calls import RemoteError
from pdserve.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from pdserve.worker.convert import FINISH_TO_PROTO, ticket_from_proto
from pdserve.worker.domain import StageCosts, TokenEvent
from pdserve.worker.streams import StreamMux

SPECIALS = ["<|bos|>", "<|eos|>", "<|system|>", "<|user|>", "<|assistant|>"]
TEXT = (
    "The harbor was quiet in the morning. Boats rested on grey water and gulls called. "
    "Café au lait, crème brûlée, naïve façade, jalapeño, Zürich, Ångström. "
    "日本語のテキスト、東京と京都。中文文本。北京和上海。 Emoji: 🚢 ⚓ 🌊 🐟 😀. "
    "END of the story, and the END again. Stop here. "
) * 4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
FINGERPRINT = "fake-model-fp"


def make_model_dir(path: Path, max_len: int = 256) -> Path:
    """tokenizer.json (byte-level BPE trained here), tokenizer_config.json with a chat
    template, config.json (llama, no weights): all the router reads."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    eos = tok.token_to_id("<|eos|>")
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": CHAT_TEMPLATE})
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "vocab_size": tok.get_vocab_size(),
                "hidden_size": 64,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "max_position_embeddings": max_len,
                "hidden_act": "silu",
                "eos_token_id": eos,
                "bos_token_id": tok.token_to_id("<|bos|>"),
            }
        )
    )
    return path


class RouterProcess:
    """`python -m pdserve.router` on a free port; ready when it prints PDSERVE_READY."""

    def __init__(self, model_dir: Path | None, *extra: str, timeout: float = 60.0) -> None:
        argv = [
            sys.executable,
            "-m",
            "pdserve.router",
            "--port",
            "0",
            "--heartbeat-interval-s",
            "0.2",
            "--heartbeat-timeout-s",
            "2.0",
            "--log-format",
            "console",
            "--log-level",
            "warning",
            "--internal-port",
            "0",
            "--insecure",  # fakes speak plaintext: this tests the router's logic, not TLS
            *extra,
        ]
        if model_dir is not None:
            argv += ["--model", str(model_dir)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
        )
        deadline = time.monotonic() + timeout
        self.port = 0
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("PDSERVE_READY"):
                info = json.loads(line.split(" ", 1)[1])
                self.port, self.internal_port = info["port"], info["internal_port"]
                break
        if not self.port:
            self.proc.kill()
            raise RuntimeError(f"router did not start: {self.proc.stderr.read()[-3000:]}")
        self.addr = f"127.0.0.1:{self.port}"  # public: the client API
        self.internal_addr = f"127.0.0.1:{self.internal_port}"  # the registry

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class Behaviour:
    prefill_error: grpc.StatusCode | None = None  # Prefill fails with this status
    decode_error: grpc.StatusCode | None = None  # Decode fails with this status at once
    decode_gate: asyncio.Event | None = None  # Decode waits for it before streaming
    reserve_gate: asyncio.Event | None = None  # Decode waits for it before its ticket
    prefill_gate: asyncio.Event | None = None  # Prefill waits for it before answering
    decode_forever: bool = False  # Decode streams until cancelled/aborted
    script: list[int] | None = None  # tokens to emit after the first (else counting)
    chunk_delay_s: float = 0.0
    first_token: int | None = None


def client_id(worker_request_id: str) -> str:
    head, sep, tail = worker_request_id.rpartition(".")
    return head if sep and len(tail) == 8 else worker_request_id


@dataclass
class Log:
    """Shared across fakes: (instance_id, method, request_id) in arrival order."""

    calls: list[tuple[str, str, str]] = field(default_factory=list)

    def of(self, request_id: str) -> list[tuple[str, str]]:
        """Calls of the client request `request_id` (workers see it with a random suffix,
        `<id>.<8 hex>`: pdserve.router.frontdoor.servicer.worker_request_id)."""
        return [(i, m) for i, m, r in self.calls if client_id(r) == request_id]

    async def wait_for(self, entry: tuple[str, str, str], timeout: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if entry in [(i, m, client_id(r)) for i, m, r in self.calls]:
                return True
            await asyncio.sleep(0.02)
        return False


class _StreamContext:
    """What a fake handler reads of its call's context, for a stream of a Streams call: the
    request id as metadata (the stream carries it), and `abort` failing the stream."""

    def __init__(self, request_id: str) -> None:
        self._request_id = request_id

    def invocation_metadata(self):
        return (("x-request-id", self._request_id),)

    async def abort(self, code: grpc.StatusCode, details: str):
        raise RemoteError(code, details)  # the stream's status: `code`


def fake_first_token(token_ids) -> int:
    return (sum(token_ids) % 50) + 100


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self,
        instance_id: str,
        role: int,
        log: Log,
        behaviour: Behaviour | None = None,
        fingerprint: str = FINGERPRINT,
    ) -> None:
        self.instance_id, self.role, self.log = instance_id, role, log
        self.b = behaviour or Behaviour()
        self.fingerprint = fingerprint
        self.server: grpc.aio.Server | None = None
        self.address = ""
        self._hb: asyncio.Task | None = None
        self._channel: grpc.aio.Channel | None = None
        self.aborted: set[str] = set()
        self.tickets = 0
        self.prompts: list[list[int]] = []  # token ids of every Prefill / Generate

    # --- lifecycle ---
    async def start(self, router_addr: str | None, heartbeat: bool = True) -> FakeWorker:
        self.server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(self, self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        self.address = f"127.0.0.1:{port}"
        if router_addr:
            self._channel = grpc.aio.insecure_channel(router_addr)
            self.registry = router_pb2_grpc.RegistryStub(self._channel)
            resp = await self.register()
            if heartbeat:
                self._hb = asyncio.create_task(self._heartbeat(resp.heartbeat_interval_s))
        return self

    async def register(self) -> router_pb2.RegisterResponse:
        return await self.registry.Register(
            router_pb2.RegisterRequest(
                instance_id=self.instance_id,
                address=self.address,
                role=self.role,
                model_fingerprint=self.fingerprint,
                block_size=4,
                load=common_pb2.WorkerLoad(free_blocks=100, total_blocks=100),
            ),
            timeout=5,
        )

    async def _heartbeat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            resp = await self.registry.Heartbeat(
                router_pb2.HeartbeatRequest(
                    instance_id=self.instance_id,
                    role=self.role,
                    state="serving",
                    load=common_pb2.WorkerLoad(free_blocks=100, total_blocks=100),
                ),
                timeout=5,
            )
            if not resp.known:
                await self.register()

    async def stop_heartbeat(self) -> None:
        if self._hb is not None:
            self._hb.cancel()
            await asyncio.gather(self._hb, return_exceptions=True)
            self._hb = None

    async def stop(self, deregister: bool = True) -> None:
        await self.stop_heartbeat()
        if self._channel is not None:
            if deregister:
                try:
                    await self.registry.Deregister(
                        router_pb2.DeregisterRequest(instance_id=self.instance_id), timeout=5
                    )
                except grpc.RpcError:
                    pass
            await self._channel.close()
        if self.server is not None:
            await self.server.stop(0)

    # --- Worker service ---
    def _rid(self, request, context) -> str:
        """The request id as the router propagates it: x-request-id metadata (it must
        equal the message's request_id, else the log shows the mismatch)."""
        md = dict(context.invocation_metadata())
        rid = md.get("x-request-id", "<no x-request-id>")
        return rid if rid == request.request_id else f"{rid}!={request.request_id}"

    def _ticket(self, request) -> worker_pb2.TokenChunk:
        self.aborted.discard(request.request_id)  # a retry re-reserves under the same id
        self.tickets += 1
        return worker_pb2.TokenChunk(
            ticket=worker_pb2.Ticket(
                ticket_id=self.tickets,
                decode_instance_id=self.instance_id,
                tag_base=1000,
                num_blocks=(len(request.prompt_token_ids) + 3) // 4,
            )
        )

    async def Prefill(self, request, context):
        self.log.calls.append((self.instance_id, "Prefill", self._rid(request, context)))
        self.prompts.append(list(request.token_ids))
        if self.b.prefill_gate is not None:
            await self.b.prefill_gate.wait()
        if self.b.prefill_error is not None:
            await context.abort(self.b.prefill_error, f"{self.instance_id} is broken")
        first = (
            self.b.first_token
            if self.b.first_token is not None
            else fake_first_token(request.token_ids)
        )
        return worker_pb2.PrefillResponse(
            first_token_id=first,
            stages=common_pb2.StageCosts(prefill_ms=1.5, cached_tokens=2, transfer_bytes=100),
        )

    async def _stream(self, request_id, first, max_tokens, context):
        if self.b.decode_gate is not None:
            await self.b.decode_gate.wait()
        n = 1
        script = list(self.b.script or [])
        while self.b.decode_forever or n < max_tokens:
            if request_id in self.aborted:
                return
            tok = script.pop(0) if script else first + n
            n += 1
            last = not self.b.decode_forever and n >= max_tokens
            if self.b.chunk_delay_s:
                await asyncio.sleep(self.b.chunk_delay_s)
            yield worker_pb2.TokenChunk(
                token_ids=[tok],
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0,
                stages=common_pb2.StageCosts(decode_ms=2.5) if last else None,
            )

    async def Decode(self, request, context):
        """The ticket first (the reservation), then the tokens after token 0 (the fake
        computes token 0 as the fake prefill does: it has the prompt)."""
        self.log.calls.append((self.instance_id, "Decode", self._rid(request, context)))
        ticket = self._ticket(request)
        if self.b.reserve_gate is not None:
            await self.b.reserve_gate.wait()
        yield ticket
        if self.b.decode_error is not None:
            await context.abort(self.b.decode_error, f"{self.instance_id} decode is broken")
        first = (
            self.b.first_token
            if self.b.first_token is not None
            else fake_first_token(request.prompt_token_ids)
        )
        async for chunk in self._stream(
            request.request_id, first, request.sampling.max_tokens, context
        ):
            yield chunk

    async def Generate(self, request, context):
        self.log.calls.append((self.instance_id, "Generate", self._rid(request, context)))
        self.prompts.append(list(request.token_ids))
        first = fake_first_token(request.token_ids)
        yield worker_pb2.TokenChunk(token_ids=[first])
        async for chunk in self._stream(
            request.request_id, first, request.sampling.max_tokens, context
        ):
            yield chunk

    async def Streams(self, request_iterator, context) -> None:
        """The router's one call per worker: each stream runs the fake's Decode / Generate
        (pdserve.worker.streams.StreamMux, as the real worker)."""
        await StreamMux(self._open_stream).serve(context)

    async def _open_stream(self, o: worker_pb2.StreamOpen):

        finish_names = {v: k for k, v in FINISH_TO_PROTO.items()}
        kind = o.WhichOneof("kind")
        request = getattr(o, kind)
        handler = self.Decode if kind == "decode" else self.Generate
        async for chunk in handler(request, _StreamContext(request.request_id)):
            if chunk.HasField("ticket"):
                yield ticket_from_proto(chunk.ticket)
                continue
            stages = None
            if chunk.HasField("stages"):
                stages = StageCosts(**{f.name: v for f, v in chunk.stages.ListFields()})
            yield TokenEvent(list(chunk.token_ids), finish_names[chunk.finish_reason], stages)

    async def Abort(self, request, context):
        self.log.calls.append((self.instance_id, "Abort", self._rid(request, context)))
        self.aborted.add(request.request_id)
        return worker_pb2.AbortResponse(found=True)
