"""Field checks of every KVStore call, before the store sees it: sizes of the lists, of each
hash and checksum, of the namespace and the UCX address, and the ranges of tags and ids.
Bad input -> InvalidRequestError (INVALID_ARGUMENT) naming the field."""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.errors import InvalidRequestError
from pdserve.kv.transfer import LAYER_BITS
from pdserve.kvstore.store import HASH_BYTES

MAX_HASHES = 1 << 16  # blocks in one chain: 1M tokens at block size 16
MAX_NAMESPACE_CHARS = 512
MAX_UCX_ADDRESS_BYTES = 1 << 14
MAX_BLOCK_BYTES = 1 << 30
CHECKSUM_BYTES = 16


def check_namespace(namespace: str) -> None:
    if len(namespace) > MAX_NAMESPACE_CHARS or not namespace.isprintable():
        raise InvalidRequestError(
            "namespace", f"at most {MAX_NAMESPACE_CHARS} printable characters"
        )


def check_hashes(hashes: Sequence[bytes], *, allow_empty: bool = True) -> None:
    if len(hashes) > MAX_HASHES:
        raise InvalidRequestError("block_hashes", f"at most {MAX_HASHES}, got {len(hashes)}")
    if not hashes and not allow_empty:
        raise InvalidRequestError("block_hashes", "must not be empty")
    for i, h in enumerate(hashes):
        if len(h) != HASH_BYTES:
            raise InvalidRequestError(
                "block_hashes", f"hash {i} has {len(h)} bytes; each must be {HASH_BYTES}"
            )


def check_chain(namespace: str, hashes: Sequence[bytes], *, allow_empty: bool = True) -> None:
    check_namespace(namespace)
    check_hashes(hashes, allow_empty=allow_empty)


def check_ucx_address(address: bytes) -> None:
    if not 0 < len(address) <= MAX_UCX_ADDRESS_BYTES:
        raise InvalidRequestError("ucx_worker_address", f"must be 1-{MAX_UCX_ADDRESS_BYTES} bytes")


def check_tag(tag: int) -> None:
    """A fetch tag: a ticket's base tag (non-zero ticket, layer bits clear)."""
    if tag == 0 or tag & ((1 << LAYER_BITS) - 1):
        raise InvalidRequestError("tag", "must be a ticket's base tag (non-zero, low 16 bits 0)")


def check_put(first_block: int, num_hashes: int, bytes_per_block: int) -> None:
    if not 0 <= first_block <= num_hashes:
        raise InvalidRequestError("first_block", f"must be in [0, {num_hashes}]")
    if not 0 < bytes_per_block <= MAX_BLOCK_BYTES:
        raise InvalidRequestError("bytes_per_block", f"must be in [1, {MAX_BLOCK_BYTES}]")


def check_checksums(checksums: Sequence[bytes]) -> None:
    if len(checksums) > MAX_HASHES:
        raise InvalidRequestError("checksums", f"at most {MAX_HASHES}")
    for i, c in enumerate(checksums):
        if len(c) != CHECKSUM_BYTES:
            raise InvalidRequestError(
                "checksums", f"checksum {i} has {len(c)} bytes; each must be {CHECKSUM_BYTES}"
            )


def check_writer(writer: str) -> None:
    if not writer or len(writer) > 256 or not writer.isascii() or not writer.isprintable():
        raise InvalidRequestError("writer", "must be a worker identity URI (1-256 chars)")
