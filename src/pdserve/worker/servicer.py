"""gRPC Worker servicer: converts between proto and domain objects, nothing else. Every
request is checked field by field (pdserve.worker.checks) before the core sees it.
`Streams` carries many Decode and Generate streams in one call (pdserve.worker.streams);
each runs through the same checks and core calls as its own call would."""

from __future__ import annotations

from collections.abc import AsyncIterator

from grpc import aio

from pdserve.engine.params import SamplingParams
from pdserve.errors import InvalidRequestError
from pdserve.rpc.ids import check_id
from pdserve.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from pdserve.worker import checks, convert
from pdserve.worker.core import WorkerCore
from pdserve.worker.domain import Ticket, TokenEvent
from pdserve.worker.streams import StreamMux


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(self, core: WorkerCore) -> None:
        self._core = core
        self._limits: checks.WorkerLimits | None = None

    @property
    def limits(self) -> checks.WorkerLimits:
        if self._limits is None:
            engine = self._core.engine
            self._limits = checks.WorkerLimits(
                vocab_size=engine.vocab_size,
                max_model_len=engine.max_model_len,
                block_size=engine.spec.block_size,
                max_lease_s=self._core.settings.max_lease_s,
            )
        return self._limits

    def _sampling(self, p: common_pb2.SamplingParams) -> SamplingParams:
        params = convert.sampling_from_proto(p)
        checks.check_sampling(params, self.limits)
        return params

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        checks.check_prefill(request, self.limits)
        first_token, stages = await self._core.prefill(
            request.request_id,
            list(request.token_ids),
            self._sampling(request.sampling),
            convert.ticket_from_proto(request.ticket) if request.HasField("ticket") else None,
            request.use_kvstore,
        )
        return worker_pb2.PrefillResponse(
            first_token_id=first_token, stages=convert.stages_to_proto(stages)
        )

    async def Decode(
        self, request: worker_pb2.DecodeRequest, context: aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        async for ev in self._decode(request):  # the ticket first, then the tokens after token 0
            if isinstance(ev, Ticket):
                yield worker_pb2.TokenChunk(ticket=convert.ticket_to_proto(ev))
            else:
                yield convert.chunk_to_proto(ev)

    async def Generate(
        self, request: worker_pb2.WorkerGenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.TokenChunk]:
        async for ev in self._generate(request):
            yield convert.chunk_to_proto(ev)

    async def Streams(
        self,
        request_iterator: AsyncIterator[worker_pb2.StreamsRequest],
        context: aio.ServicerContext,
    ) -> None:
        await StreamMux(self._open_stream).serve(context)

    def _open_stream(self, o: worker_pb2.StreamOpen) -> AsyncIterator[Ticket | TokenEvent]:
        kind = o.WhichOneof("kind")
        if kind == "decode":
            return self._decode(o.decode)
        if kind == "generate":
            return self._generate(o.generate)
        raise InvalidRequestError("kind", "a stream opens a decode or a generate request")

    def _decode(self, request: worker_pb2.DecodeRequest) -> AsyncIterator[Ticket | TokenEvent]:
        checks.check_decode(request, self.limits)
        return self._core.decode(
            request.request_id,
            list(request.prompt_token_ids),
            self._sampling(request.sampling),
            request.lease_s,
            request.num_predicted_tokens,
            request.write_back,
        )

    def _generate(self, request: worker_pb2.WorkerGenerateRequest) -> AsyncIterator[TokenEvent]:
        checks.check_generate(request, self.limits)
        return self._core.generate(
            request.request_id,
            list(request.token_ids),
            self._sampling(request.sampling),
            request.use_kvstore,
            request.write_back,
        )

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        check_id("request_id", request.request_id)
        return worker_pb2.AbortResponse(found=await self._core.abort(request.request_id))

    async def SetRole(
        self, request: worker_pb2.SetRoleRequest, context: aio.ServicerContext
    ) -> worker_pb2.SetRoleResponse:
        role = convert.role_from_proto(request.role)
        new_role = await self._core.set_role(role)
        return worker_pb2.SetRoleResponse(role=convert.ROLE_TO_PROTO[new_role])

    async def Drain(
        self, request: worker_pb2.DrainRequest, context: aio.ServicerContext
    ) -> worker_pb2.DrainResponse:
        remaining = await self._core.drain_for_rpc()
        return worker_pb2.DrainResponse(remaining=remaining)

    async def Info(
        self, request: worker_pb2.InfoRequest, context: aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        core = self._core
        engine = core.engine
        return worker_pb2.WorkerInfo(
            instance_id=core.instance_id,
            role=convert.ROLE_TO_PROTO[core.role],
            state=core.state,
            model_fingerprint=engine.model_fingerprint,
            kv_fingerprint=engine.kv_fingerprint,
            block_size=engine.spec.block_size,
            num_layers=engine.spec.num_layers,
            bytes_per_block=engine.spec.bytes_per_block,
            load=core.load_snapshot().to_proto(),
            counters=core.counters(),
        )
