"""Field checks of every Worker call (the internal API the router drives), in the servicer
layer, before the engine or the KV pool sees the request: ids, token ids, sampling, the
lease (finite, >= 0, at most the worker's max_lease_s), ticket fields (tag range, block
count, UCX address size). Bad input -> InvalidRequestError (INVALID_ARGUMENT) naming the
field; nothing is allocated before the checks pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.params import SamplingParams, validate_params
from pdserve.errors import InvalidRequestError
from pdserve.kv.transfer import LAYER_BITS
from pdserve.rpc.ids import check_id
from pdserve.v1 import worker_pb2
from pdserve.worker.nonce import NONCE_BYTES

MAX_UCX_ADDRESS_BYTES = 1 << 14
MAX_FINGERPRINT_CHARS = 256


@dataclass(frozen=True)
class WorkerLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    max_lease_s: float


def check_tokens(field: str, ids: Sequence[int], lim: WorkerLimits, *, allow_empty=False) -> None:
    n = len(ids)
    if n == 0 and not allow_empty:
        raise InvalidRequestError(field, "must contain at least 1 token")
    if n > lim.max_model_len:
        raise InvalidRequestError(field, f"{n} tokens; at most {lim.max_model_len}")
    if n and not (0 <= min(ids) and max(ids) < lim.vocab_size):
        raise InvalidRequestError(field, f"token ids must be in [0, {lim.vocab_size})")


def check_sampling(params: SamplingParams, lim: WorkerLimits) -> None:
    validate_params(params)
    if params.max_tokens > lim.max_model_len:
        raise InvalidRequestError("max_tokens", f"at most {lim.max_model_len}")
    if len(params.stop_token_ids) > 1024:
        raise InvalidRequestError("stop_token_ids", "at most 1024")
    check_tokens("stop_token_ids", params.stop_token_ids, lim, allow_empty=True)


def check_lease(lease_s: float, lim: WorkerLimits) -> None:
    if not math.isfinite(lease_s) or lease_s < 0 or lease_s > lim.max_lease_s:
        raise InvalidRequestError(
            "lease_s", f"must be a finite number in [0, {lim.max_lease_s:g}] (0 = default)"
        )


def check_tag_base(field: str, tag: int) -> None:
    if tag == 0 or tag & ((1 << LAYER_BITS) - 1):
        raise InvalidRequestError(field, "must be a ticket's base tag (non-zero, low 16 bits 0)")


def check_ticket(t: worker_pb2.Ticket, num_tokens: int, lim: WorkerLimits) -> None:
    check_tag_base("ticket.tag_base", t.tag_base)
    if t.ticket_id == 0:
        raise InvalidRequestError("ticket.ticket_id", "must be set")
    if not 0 < len(t.ucx_worker_address) <= MAX_UCX_ADDRESS_BYTES:
        raise InvalidRequestError(
            "ticket.ucx_worker_address", f"must be 1-{MAX_UCX_ADDRESS_BYTES} bytes"
        )
    need = -(-num_tokens // lim.block_size)
    if t.num_blocks != need:
        raise InvalidRequestError(
            "ticket.num_blocks", f"must be {need} for {num_tokens} tokens, got {t.num_blocks}"
        )
    if not math.isfinite(t.lease_expiry_unix_s) or t.lease_expiry_unix_s < 0:
        raise InvalidRequestError("ticket.lease_expiry_unix_s", "must be a finite time")
    fp = t.kv_fingerprint
    if len(fp) > MAX_FINGERPRINT_CHARS or not fp.isprintable():
        raise InvalidRequestError("ticket.kv_fingerprint", "too long or not printable")
    check_id("ticket.decode_instance_id", t.decode_instance_id, required=False)
    if len(t.nonce) not in (0, NONCE_BYTES):
        raise InvalidRequestError("ticket.nonce", f"must be {NONCE_BYTES} bytes")


def check_prefill(req: worker_pb2.PrefillRequest, lim: WorkerLimits) -> None:
    check_id("request_id", req.request_id)
    check_tokens("token_ids", req.token_ids, lim)
    if not req.HasField("ticket"):  # prefill only: token 0 is the whole answer
        if req.sampling.max_tokens != 1:
            raise InvalidRequestError(
                "ticket", "must be set unless sampling.max_tokens is 1 (prefill only)"
            )
        return
    check_ticket(req.ticket, len(req.token_ids), lim)


def check_decode(req: worker_pb2.DecodeRequest, lim: WorkerLimits) -> None:
    """The one call that reserves and decodes: its prompt, sampling, headroom and lease."""
    check_id("request_id", req.request_id)
    check_tokens("prompt_token_ids", req.prompt_token_ids, lim)
    if not req.HasField("sampling"):
        raise InvalidRequestError("sampling", "required with Decode")
    if req.num_predicted_tokens > lim.max_model_len:
        raise InvalidRequestError("num_predicted_tokens", f"at most {lim.max_model_len}")
    check_lease(req.lease_s, lim)


def check_generate(req: worker_pb2.WorkerGenerateRequest, lim: WorkerLimits) -> None:
    check_id("request_id", req.request_id)
    check_tokens("token_ids", req.token_ids, lim)
