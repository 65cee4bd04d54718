"""Capacity-curve simulation of the kvstore's prefix block cache on a Mooncake trace (no cluster).

The eviction is the kvstore's own: each request drives a real `pdserve.kvstore.store.BlockStore`
(lookup, then begin_put/commit_put of the missing blocks), sized in blocks (one arena byte per
block, no KV data is written), so this curve changes whenever the store's policy does. The
store evicts the least recently used *leaf* of a chain, so chains shrink from their tail and a
lookup is a longest-prefix match.

With a disk tier (`disk_blocks`), the store is the service's two-tier one: every stored block
is written through to the disk tier right after its put (the sim runs the write queue at
once, with no files: the service does the same bookkeeping with a thread doing the I/O),
RAM keeps the most recent copies and the disk budget bounds what stays stored.

Only full blocks are cacheable (a real store keys full blocks only): the last hash id of a
prompt covers a partial block unless the prompt length is a multiple of the block size.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.kvstore.store import HASH_BYTES, BlockStore
from pdserve.workload.traces import MOONCAKE_BLOCK_TOKENS, TraceRecord

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_tiers(spec: str) -> tuple[int | None, int]:
    """ "1GiB" -> (RAM, 0); "1GiB+16GiB" -> (RAM, disk); "unlimited" -> (None, 0)."""
    ram, _, disk = spec.partition("+")
    disk_bytes = parse_capacity(disk) if disk else 0
    if disk and disk_bytes is None:
        raise ValueError(f"bad capacity {spec!r}: the disk tier must be finite")
    return parse_capacity(ram), disk_bytes or 0


def parse_capacity(spec: str) -> int | None:
    """ "64MiB" | "1GiB" | "500MB" | "1048576" -> bytes; "unlimited" -> None."""
    text = spec.strip().lower()
    if text in ("unlimited", "inf", "none"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"bad capacity {spec!r}: use e.g. 64MiB, 1GiB, 500MB or unlimited")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


NAMESPACE = "cachesim"


def block_key(hash_id: int) -> bytes:
    """A trace hash id as the store's 16-byte block hash."""
    return int(hash_id).to_bytes(HASH_BYTES, "big", signed=False)


class StoreCache:
    """A `BlockStore` of `capacity_blocks` one-byte blocks (None = never evicts), driven the
    way the workers drive the kvstore: look the chain up, then publish what is missing."""

    def __init__(
        self, capacity_blocks: int | None, universe: int = 0, disk_blocks: int = 0
    ) -> None:
        cap = capacity_blocks if capacity_blocks is not None else max(1, universe)
        self.capacity = capacity_blocks
        self.store: BlockStore | None = (
            BlockStore(cap, block_bytes=1, disk_bytes=disk_blocks) if cap > 0 else None
        )

    def __len__(self) -> int:
        return self.store.snapshot().num_blocks if self.store else 0

    @property
    def evictions(self) -> int:
        return self.store.stats.evictions if self.store else 0

    @property
    def disk_hits(self) -> int:
        return self.store.stats.disk_hits if self.store else 0

    def lookup(self, chain: Sequence[int]) -> int:
        """Leading blocks of `chain` that are stored (touches them, as a fetch does)."""
        if self.store is None or not chain:
            return 0
        return self.store.lookup(NAMESPACE, [block_key(h) for h in chain])

    def contains(self, chain: Sequence[int]) -> int:
        if self.store is None or not chain:
            return 0
        return self.store.contains(NAMESPACE, [block_key(h) for h in chain])

    def insert(self, chain: Sequence[int]) -> int:
        """Publish `chain` (the store stores the blocks it lacks). Returns blocks stored."""
        if self.store is None or not chain:
            return 0
        res = self.store.begin_put(NAMESPACE, [block_key(h) for h in chain], 0, 1)
        if res is None or not res.slots:
            return 0
        stored = self.store.commit_put(res.put_id, [b""] * len(res.slots))
        while blocks := self.store.disk.take_writes(1 << 62):  # write-through, at once
            self.store.disk.finish_writes(blocks, [True] * len(blocks))
        self.store.disk.take_unlinks()
        return stored

    def check_integrity(self) -> None:
        if self.store is not None:
            self.store.check_integrity()


def full_blocks(rec: TraceRecord, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[int]:
    """The hash ids of `rec` that cover a full block."""
    n_full = min(len(rec.hash_ids), rec.input_len // block_tokens)
    return list(rec.hash_ids[:n_full])


@dataclass(frozen=True)
class SimResult:
    capacity_bytes: int | None
    capacity_blocks: int | None
    prompt_tokens: int
    hit_tokens: int
    evictions: int
    disk_bytes: int = 0
    disk_hit_tokens: int = 0  # of hit_tokens, found on the disk tier only

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate(
    records: Sequence[TraceRecord],
    capacity_bytes: int | None,
    block_bytes: int,
    disk_bytes: int = 0,
) -> SimResult:
    """Replay `records` through the store with `capacity_bytes` of RAM (+ `disk_bytes` of
    disk tier); one block = one hash id."""
    cap_blocks = None if capacity_bytes is None else capacity_bytes // block_bytes
    universe = len({h for rec in records for h in full_blocks(rec)})
    cache = StoreCache(cap_blocks, universe, disk_bytes // block_bytes)
    prompt = hits = 0
    for rec in records:
        chain = full_blocks(rec)
        prompt += rec.input_len
        hits += cache.lookup(chain) * MOONCAKE_BLOCK_TOKENS
        cache.insert(chain)
    disk_hits = cache.disk_hits * MOONCAKE_BLOCK_TOKENS
    return SimResult(
        capacity_bytes, cap_blocks, prompt, hits, cache.evictions, disk_bytes, disk_hits
    )
