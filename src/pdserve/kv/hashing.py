"""Chained 128-bit block hashes (torch-free; the router and kvstore use them too).

h_0 = root_hash(namespace); h_i = H(h_{i-1} || int32-LE tokens of block i || utf-8 namespace)
with H = blake2b(digest_size=16). Only full blocks are hashed. The result is identical across
processes and machines: it depends only on the bytes above.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

HASH_BYTES = 16
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def root_hash(namespace: str) -> bytes:
    """The parent of the first block: seeded by the namespace (KVSpec.fingerprint)."""
    return hashlib.blake2b(
        b"pdserve-root|" + namespace.encode("utf-8"), digest_size=HASH_BYTES
    ).digest()


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    try:  # struct checks the int32 range itself (in C): the Python check only on failure
        return struct.pack(f"<{len(tokens)}i", *tokens)
    except struct.error:
        for t in tokens:
            if not _INT32_MIN <= t <= _INT32_MAX:
                raise ValueError(f"token id {t} does not fit in int32") from None
        raise


def hash_block(parent: bytes, tokens: Sequence[int], namespace: str) -> bytes:
    if len(parent) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(parent)}")
    h = hashlib.blake2b(digest_size=HASH_BYTES)
    h.update(parent)
    h.update(_encode_tokens(tokens))
    h.update(namespace.encode("utf-8"))
    return h.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    namespace: str,
    parent: bytes | None = None,
) -> list[bytes]:
    """Hashes of every full block of `token_ids`, chained from `parent` (default: the root)."""
    if block_size < 1:
        raise ValueError("block_size must be >= 1")
    prev = root_hash(namespace) if parent is None else parent
    n = len(token_ids) // block_size
    if n == 0:
        return []
    if len(prev) != HASH_BYTES:
        raise ValueError(f"parent hash must be {HASH_BYTES} bytes, got {len(prev)}")
    # hash_block's bytes for each block (parent || int32-LE tokens || namespace), with the
    # tokens packed and the namespace encoded once for the whole run
    data = _encode_tokens(token_ids[: n * block_size])
    ns = namespace.encode("utf-8")
    step = 4 * block_size
    blake2b = hashlib.blake2b
    out: list[bytes] = []
    for a in range(0, n * step, step):
        prev = blake2b(prev + data[a : a + step] + ns, digest_size=HASH_BYTES).digest()
        out.append(prev)
    return out
