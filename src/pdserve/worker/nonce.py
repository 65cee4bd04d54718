"""The ticket nonce: proof that KV arriving over UCX comes from the prefill the router sent.

UCX cannot carry TLS, so a decode's reservation is protected by two secrets from its ticket,
which only travels over mutual-TLS gRPC (decode -> router -> prefill): the random 48-bit tag
base (a receive matches only its exact tag) and a 16-byte nonce. The prefill sends the nonce
with token 0, the last message of a request; the decode compares it (constant time) before it
admits the received KV into its engine, and discards the KV on a mismatch (counted as
`nonce_mismatch`). A ticket is single use: its receives are retired once it ends.
"""

from __future__ import annotations

import hmac
import secrets

import numpy as np

NONCE_BYTES = 16
TOKEN_MESSAGE_INT32 = 1 + NONCE_BYTES // 4  # token 0, then the nonce


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def token_buffer() -> np.ndarray:
    """The decode's receive buffer for token 0 + nonce (zeros: a short message never
    matches)."""
    return np.zeros(TOKEN_MESSAGE_INT32, dtype=np.int32)


def token_message(token: int, nonce: bytes) -> np.ndarray:
    """What the prefill sends: int32 token 0, then the ticket's nonce."""
    buf = token_buffer()
    buf[0] = token
    if len(nonce) == NONCE_BYTES:
        buf[1:] = np.frombuffer(nonce, dtype=np.int32)
    return buf


def nonce_matches(buf: np.ndarray, nonce: bytes) -> bool:
    return len(nonce) == NONCE_BYTES and hmac.compare_digest(buf[1:].tobytes(), nonce)
