"""proto <-> domain conversions for the worker API (the servicer's only vocabulary)."""

from __future__ import annotations

from pdserve.engine.params import SamplingParams
from pdserve.v1 import common_pb2, worker_pb2
from pdserve.worker.domain import StageCosts, Ticket, TokenEvent

ROLE_TO_PROTO = {
    "prefill": common_pb2.ROLE_PREFILL,
    "decode": common_pb2.ROLE_DECODE,
    "colocated": common_pb2.ROLE_COLOCATED,
}
ROLE_FROM_PROTO = {v: k for k, v in ROLE_TO_PROTO.items()}

FINISH_TO_PROTO = {
    None: common_pb2.FINISH_REASON_UNSPECIFIED,
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
}


def sampling_from_proto(p: common_pb2.SamplingParams) -> SamplingParams:
    """Unset optional fields take the engine defaults. Validation happens in the engine."""
    defaults = SamplingParams()
    return SamplingParams(
        max_tokens=p.max_tokens if p.HasField("max_tokens") else defaults.max_tokens,
        temperature=p.temperature if p.HasField("temperature") else defaults.temperature,
        top_p=p.top_p if p.HasField("top_p") else defaults.top_p,
        top_k=p.top_k,
        seed=p.seed if p.HasField("seed") else None,
        stop_token_ids=tuple(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        output_offset=p.output_offset,
    )


def ticket_to_proto(t: Ticket) -> worker_pb2.Ticket:
    return worker_pb2.Ticket(
        ticket_id=t.ticket_id,
        decode_instance_id=t.decode_instance_id,
        ucx_worker_address=t.ucx_worker_address,
        tag_base=t.tag_base,
        lease_expiry_unix_s=t.lease_expiry_unix_s,
        num_blocks=t.num_blocks,
        kv_fingerprint=t.kv_fingerprint,
        nonce=t.nonce,
    )


def ticket_from_proto(p: worker_pb2.Ticket) -> Ticket:
    return Ticket(
        ticket_id=p.ticket_id,
        decode_instance_id=p.decode_instance_id,
        ucx_worker_address=bytes(p.ucx_worker_address),
        tag_base=p.tag_base,
        lease_expiry_unix_s=p.lease_expiry_unix_s,
        num_blocks=p.num_blocks,
        kv_fingerprint=p.kv_fingerprint,
        nonce=bytes(p.nonce),
    )


def stages_to_proto(s: StageCosts) -> common_pb2.StageCosts:
    return common_pb2.StageCosts(
        queue_ms=s.queue_ms,
        prefill_ms=s.prefill_ms,
        transfer_ms=s.transfer_ms,
        transfer_bytes=s.transfer_bytes,
        decode_ms=s.decode_ms,
        cached_tokens=s.cached_tokens,
        kvstore_tokens=s.kvstore_tokens,
    )


def chunk_to_proto(ev: TokenEvent) -> worker_pb2.TokenChunk:
    chunk = worker_pb2.TokenChunk(
        token_ids=ev.token_ids, finish_reason=FINISH_TO_PROTO.get(ev.finish_reason, 0)
    )
    if ev.stages is not None:
        chunk.stages.CopyFrom(stages_to_proto(ev.stages))
    return chunk


def role_from_proto(role: int) -> str:
    from pdserve.errors import InvalidRequestError

    if role not in ROLE_FROM_PROTO:
        raise InvalidRequestError("role", "must be ROLE_PREFILL, ROLE_DECODE or ROLE_COLOCATED")
    return ROLE_FROM_PROTO[role]
