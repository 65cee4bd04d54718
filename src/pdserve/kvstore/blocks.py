"""The kvstore's block records: a stored block and an open put (bookkeeping only)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

from pdserve.kvstore.arena import Slot
from pdserve.kvstore.disk import DiskMeta

HASH_BYTES = 16
Key = tuple[str, bytes]


def checksum(data: np.ndarray) -> bytes:
    """blake2b-128 of a block's bytes (the wire checksum of Fetch and CommitPut)."""
    return hashlib.blake2b(memoryview(data), digest_size=16).digest()


@dataclass(eq=False)
class Block:
    key: Key
    parent: Block | None
    slot: Slot | None  # the RAM copy (None: on disk only, or a ghost)
    checksum: bytes
    depth: int  # position in its chain (0 = first block)
    nbytes: int = 0
    disk_name: str = ""  # its file, once a write was scheduled
    on_disk: bool = False  # the file is written (the write finished and succeeded)
    writing: bool = False
    children: int = 0
    pins: int = 0
    refs: int = 0
    last_used: int = 0
    writer: str = ""  # identity (certificate URI) of the worker that put it; "" = anonymous

    @property
    def ghost(self) -> bool:
        return self.slot is None and not self.on_disk and not self.writing

    def meta(self) -> DiskMeta:
        """Its disk header (every field is immutable once the block is stored)."""
        parent = self.parent.key[1] if self.parent is not None else b""
        ns, h = self.key
        return DiskMeta(ns, h, parent, self.depth, self.checksum, self.writer, self.nbytes)


@dataclass(eq=False)
class PutReservation:
    put_id: int
    namespace: str
    hashes: list[bytes]  # the accepted blocks, in chain order
    first_block: int  # chain position of hashes[0]
    block_bytes: int
    parent: Block | None  # referenced until commit/abort so it cannot be evicted
    slots: list[Slot] = field(default_factory=list)
    writer: str = ""
    chained: bool = True  # False: window parts (kvstore/window.py), each stored alone

    @property
    def nbytes(self) -> int:
        return len(self.slots) * self.block_bytes
