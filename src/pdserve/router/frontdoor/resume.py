"""Resume tokens: a stream outlives its router (docs/ARCHITECTURE.md, "Router replicas").

The router that starts a stream hands the client, with its first tokens, an opaque token:

    v1.<expiry unix s>.<request id>.<mac>      mac = HMAC-SHA256(secret, fields)[:16], base64url
    fields = "pdserve-resume-v1" | expiry | request id | API key name | request digest

where the request digest covers what decides the stream's tokens: the tokenized prompt, the
validated sampling parameters and the session id. Every replica holds the same secret
(`--resume-secret-file`, else derived from the router's TLS key), so any of them checks a
token without shared state: nothing to look up, nothing lost with a replica.

`ResumeCheck.verify` tells the three failures apart: a token of another API key
(PERMISSION_DENIED: the MAC verifies under another configured key name), an unknown stream
(NOT_FOUND: any other MAC failure, expiry, another request id), a malformed token
(INVALID_ARGUMENT). `finished_reason` decides "finished" from the resume request itself:
the received tokens reached max_tokens or the context, or contain an EOS or stop token, or
their text completes a stop string. Such a resume is refused (FAILED_PRECONDITION) instead
of generating past the end.
"""

from __future__ import annotations

import array
import base64
import hashlib
import hmac
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pdserve.errors import (
    FailedPreconditionError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
)
from pdserve.logging import get_logger

from ..job import Job

log = get_logger("pdserve.router.frontdoor.resume")

VERSION = "v1"
DOMAIN = b"pdserve-resume-v1"
MAC_BYTES = 16
MAX_TOKEN_CHARS = 512


def request_digest(job: Job) -> bytes:
    """What decides a stream's tokens: prompt token ids, sampling parameters, session."""
    p = job.params
    h = hashlib.blake2b(digest_size=16)
    ids = array.array("i", job.token_ids)
    if sys.byteorder != "little":
        ids.byteswap()
    h.update(ids.tobytes())  # int32 little-endian, as the block hashes encode tokens
    h.update(
        repr(
            (
                p.max_tokens,
                p.temperature,
                p.top_p,
                p.top_k,
                p.seed,
                p.ignore_eos,
                tuple(p.stop_token_ids),
                job.session_id,
            )
        ).encode()
    )
    return h.digest()


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ResumeTokens:
    """Issues and checks resume tokens with one secret (the same on every replica)."""

    def __init__(
        self, secret: bytes, ttl_s: float = 3600.0, clock: Callable[[], float] = time.time
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the resume secret must be at least 16 bytes")
        self._secret = secret
        self.ttl_s = ttl_s
        self._clock = clock

    def _mac(self, expiry: int, rid: str, key_name: str, digest: bytes) -> bytes:
        msg = b"|".join((DOMAIN, str(expiry).encode(), rid.encode(), key_name.encode(), digest))
        return hmac.new(self._secret, msg, hashlib.sha256).digest()[:MAC_BYTES]

    def issue(self, rid: str, key_name: str, job: Job) -> str:
        expiry = int(self._clock() + self.ttl_s)
        mac = self._mac(expiry, rid, key_name, request_digest(job))
        return f"{VERSION}.{expiry}.{rid}.{_b64(mac)}"

    def verify(self, token: str, rid: str, key_name: str, job: Job, others: Iterable[str]):
        """Raises unless `token` was issued for request `rid` of key `key_name` with this
        prompt and sampling (see the module docstring for which error)."""
        if not token:
            raise InvalidRequestError(
                "resume_token", "missing (it comes with the stream's first tokens)"
            )
        if len(token) > MAX_TOKEN_CHARS:
            raise InvalidRequestError("resume_token", f"longer than {MAX_TOKEN_CHARS} characters")
        version, _, rest = token.partition(".")
        expiry_text, _, rest = rest.partition(".")
        token_rid, _, mac_text = rest.rpartition(".")
        try:
            expiry, mac = int(expiry_text), _unb64(mac_text)
        except ValueError:
            raise InvalidRequestError("resume_token", "malformed") from None
        if version != VERSION or len(mac) != MAC_BYTES or not token_rid:
            raise InvalidRequestError("resume_token", "malformed")
        if token_rid != rid:
            raise NotFoundError(
                f"unknown stream: the resume token belongs to request {token_rid!r}, not {rid!r}"
            )
        digest = request_digest(job)
        if hmac.compare_digest(mac, self._mac(expiry, rid, key_name, digest)):
            if expiry < self._clock():
                raise NotFoundError(f"unknown stream {rid!r}: its resume token expired")
            return
        for other in others:
            if other != key_name and hmac.compare_digest(
                mac, self._mac(expiry, rid, other, digest)
            ):
                raise PermissionDeniedError(
                    f"stream {rid!r} was started with another API key; only that key may resume it"
                )
        raise NotFoundError(
            f"unknown stream {rid!r}: no router of this cluster started it with this request "
            "(prompt, sampling and session must be the original ones)"
        )


def finished_reason(
    job: Job, received: Sequence[int], eos_token_ids: Iterable[int], max_model_len: int
) -> str | None:
    """Why a stream that produced `received` is already over, or None. (A stop string is
    checked by the caller, which replays the text.)"""
    p = job.params
    if len(received) >= p.max_tokens:
        return f"all {p.max_tokens} tokens (max_tokens) were received"
    if len(job.token_ids) + len(received) >= max_model_len:
        return f"prompt + received tokens reach the context length ({max_model_len})"
    ends = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
    for i, tid in enumerate(received):
        if tid in ends:
            return f"received token {i} ({tid}) is an end-of-sequence or stop token"
    return None


def check_finished(reason: str | None, rid: str) -> None:
    if reason is not None:
        raise FailedPreconditionError(f"stream {rid!r} already finished: {reason}")


def load_secret(
    secret_file: str | None, tls_key_file: str | None, insecure_fallback: bytes | None = None
) -> tuple[bytes, str]:
    """(secret, where it came from). Order: the secret file; else a key derived from the
    router's TLS private key (every replica of a cluster holds the same router key); else
    `insecure_fallback` (a random secret: resume then works on this replica only)."""
    if secret_file:
        raw = Path(secret_file).read_bytes().strip()
        if len(raw) < 16:
            raise ValueError(f"resume secret file {secret_file}: at least 16 bytes needed")
        return raw, f"file {secret_file}"
    if tls_key_file and Path(tls_key_file).is_file():
        key = Path(tls_key_file).read_bytes()
        return hmac.new(key, DOMAIN, hashlib.sha256).digest(), f"derived from {tls_key_file}"
    if insecure_fallback is None:
        raise ValueError("no resume secret: set --resume-secret-file or run with TLS")
    log.warning(
        "no resume secret shared with other replicas (no --resume-secret-file, no TLS key): "
        "a stream can be resumed on this replica only"
    )
    return insecure_fallback, "random (this replica only)"


def accept_resume(
    resume: Any,  # router_pb2.ResumeRequest
    tokens: ResumeTokens,
    key_name: str,
    key_names: Iterable[str],
    rid: str,
    job: Job,
    text: Any,  # text.TextStream: replays the received tokens (stop strings see the seam)
    model: Any,  # model_info.ModelInfo: vocabulary, context length, EOS ids
) -> tuple[list[int], str]:
    """Check a resume of `job` (token, key, received ids, not finished) and replay what the
    client received: (the received tokens, the text it is still owed). `job.output_token_ids`
    becomes the received tokens (the stream's tokens so far)."""
    received = list(resume.received_token_ids)
    tokens.verify(resume.resume_token, rid, key_name, job, key_names)
    vocab = model.vocab_size
    bad = next((i for i, t in enumerate(received) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequestError(
            "received_token_ids",
            f"token at index {bad} ({received[bad]}) is outside the vocabulary [0, {vocab})",
        )
    check_finished(finished_reason(job, received, model.eos_token_ids, model.max_model_len), rid)
    if text.push(received).stopped:
        check_finished(f"the received text completes stop string {text.matcher.matched!r}", rid)
    job.output_token_ids = list(received)
    sent = resume.received_text
    owed = text.text[len(sent) :] if text.text.startswith(sent) else ""
    return received, owed
