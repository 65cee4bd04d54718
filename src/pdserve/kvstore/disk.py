"""DiskFiles: the kvstore's disk tier as one file per block (file I/O only, no bookkeeping).

Every call is blocking and thread-safe (each touches only its own file), so the service runs
them in worker threads, never on the event loop. The bookkeeping (which block is on disk, the
LRU, the byte budget) is BlockStore's.

File layout, `<dir>/<name[:2]>/<name>`, name = `<blake2b(namespace, hash) hex>.<generation>.kvb`
(the generation makes a re-written block a new file, so a late unlink of an evicted copy can
never delete a newer one):

    MAGIC (8) | u32 header length | header JSON | blake2b-128 of the header JSON | block bytes

The header carries what a restart needs to rebuild the index (namespace, hash, parent hash,
depth, checksum, writer, size). A read is verified end to end: header digest, key, size and
the block's blake2b-128 against the checksum the store holds; any mismatch or a short file
reads as None (a miss), never as wrong KV. Files are created with mode 0600 in directories of
mode 0700, written to a temporary name and renamed, so a crash leaves no half-written block
under a real name (no fsync: a crash may lose recent blocks, and the checksum catches a torn
one).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MAGIC = b"PDKVBLK1"
SUFFIX = ".kvb"
_LEN = struct.Struct("<I")
MAX_HEADER = 1 << 16


def _digest(data: bytes | memoryview | np.ndarray) -> bytes:
    return hashlib.blake2b(memoryview(data), digest_size=16).digest()


@dataclass(frozen=True)
class DiskMeta:
    """One block file's header (what `scan` finds after a restart)."""

    namespace: str
    hash: bytes
    parent: bytes  # b"" for a chain's first block
    depth: int
    checksum: bytes
    writer: str
    nbytes: int
    name: str = ""
    mtime: float = 0.0

    def header(self) -> bytes:
        return json.dumps(
            {
                "ns": self.namespace,
                "hash": self.hash.hex(),
                "parent": self.parent.hex(),
                "depth": self.depth,
                "checksum": self.checksum.hex(),
                "writer": self.writer,
                "nbytes": self.nbytes,
            },
            sort_keys=True,
        ).encode()


def file_name(namespace: str, block_hash: bytes, generation: int) -> str:
    key = hashlib.blake2b(namespace.encode() + b"\0" + block_hash, digest_size=16).hexdigest()
    return f"{key}.{generation}{SUFFIX}"


def generation_of(name: str) -> int:
    return int(name.split(".")[1])


class DiskFiles:
    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(self.dir, 0o700)

    def path(self, name: str) -> Path:
        return self.dir / name[:2] / name

    def write(self, name: str, meta: DiskMeta, data: np.ndarray) -> int:
        """Write one block file (atomically, mode 0600). Returns the file's size."""
        header = meta.header()
        path = self.path(name)
        path.parent.mkdir(exist_ok=True, mode=0o700)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(MAGIC + _LEN.pack(len(header)) + header + _digest(header))
                f.write(memoryview(data))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return len(MAGIC) + _LEN.size + len(header) + 16 + data.nbytes

    def read(self, name: str, meta: DiskMeta, out: np.ndarray) -> bool:
        """Read a block into `out` (nbytes long) if its file is intact and is the block `meta`
        names (key, size and data checksum); False otherwise, `out` then holds garbage."""
        try:
            with open(self.path(name), "rb") as f:
                got = self._read_header(f)
                if got is None or got.header() != meta.header():
                    return False
                n = f.readinto(memoryview(out))
                if n != meta.nbytes or f.read(1):
                    return False
        except (OSError, ValueError):
            return False
        return _digest(out) == meta.checksum

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path(name))

    def scan(self) -> tuple[list[DiskMeta], list[str]]:
        """Every block file's header (for a restart), and the names of unreadable files and
        leftover temporaries (to delete). Reads headers only, not the block bytes."""
        good: list[DiskMeta] = []
        bad: list[str] = []
        for sub in sorted(p for p in self.dir.iterdir() if p.is_dir()):
            for path in sorted(sub.iterdir()):
                if path.suffix != SUFFIX:
                    path.unlink(missing_ok=True)  # a temporary left by a crash
                    continue
                try:
                    with open(path, "rb") as f:
                        meta = self._read_header(f)
                        size = os.fstat(f.fileno()).st_size
                        mtime = os.fstat(f.fileno()).st_mtime
                    generation_of(path.name)
                except (OSError, ValueError, IndexError):
                    meta = None
                if meta is None or size != f_size(meta):
                    bad.append(path.name)
                    continue
                good.append(DiskMeta(**{**meta.__dict__, "name": path.name, "mtime": mtime}))
        return good, bad

    @staticmethod
    def _read_header(f) -> DiskMeta | None:
        head = f.read(len(MAGIC) + _LEN.size)
        if len(head) != len(MAGIC) + _LEN.size or head[: len(MAGIC)] != MAGIC:
            return None
        (n,) = _LEN.unpack(head[len(MAGIC) :])
        if n > MAX_HEADER:
            return None
        header, digest = f.read(n), f.read(16)
        if len(header) != n or _digest(header) != digest:
            return None
        h = json.loads(header)
        return DiskMeta(
            str(h["ns"]),
            bytes.fromhex(h["hash"]),
            bytes.fromhex(h["parent"]),
            int(h["depth"]),
            bytes.fromhex(h["checksum"]),
            str(h["writer"]),
            int(h["nbytes"]),
        )


def f_size(meta: DiskMeta) -> int:
    """The size of `meta`'s block file."""
    return len(MAGIC) + _LEN.size + len(meta.header()) + 16 + meta.nbytes
