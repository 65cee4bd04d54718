"""Capacity-curve simulation of a prefix block cache on a Mooncake trace (no cluster).

`ChainLRU` models the kvstore's eviction: blocks form chains (a block's parent is the previous
block of the prompt); only a block without cached children may be evicted, the least recently
used such leaf first, so chains shrink from their tail and every cached block keeps its whole
prefix cached (a lookup is a longest-prefix match). A request first looks up its chain (the
hit), then inserts/touches all of its full blocks.

Only full blocks are cacheable (a real store keys full blocks only): the last hash id of a
prompt covers a partial block unless the prompt length is a multiple of the block size.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.bench.traces import MOONCAKE_BLOCK_TOKENS, TraceRecord

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


def parse_capacity(spec: str) -> int | None:
    """ "64MiB" | "1GiB" | "500MB" | "1048576" -> bytes; "unlimited" -> None."""
    text = spec.strip().lower()
    if text in ("unlimited", "inf", "none"):
        return None
    m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([a-z]*)", text)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"bad capacity {spec!r}: use e.g. 64MiB, 1GiB, 500MB or unlimited")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


@dataclass
class _Node:
    parent: int | None
    depth: int
    stamp: int
    children: int = 0


class ChainLRU:
    def __init__(self, capacity_blocks: int | None) -> None:
        self.capacity = capacity_blocks  # None = unlimited
        self.nodes: dict[int, _Node] = {}
        self._heap: list[tuple[int, int, int]] = []  # (stamp, -depth, key): deeper goes first
        self._clock = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self.nodes)

    def lookup(self, chain: Sequence[int]) -> int:
        """Number of leading blocks of `chain` that are cached."""
        n = 0
        for key in chain:
            if key not in self.nodes:
                break
            n += 1
        return n

    def insert(self, chain: Sequence[int]) -> None:
        """Touch every block of `chain` (inserting missing ones), then evict to capacity."""
        self._clock += 1
        parent: int | None = None
        for depth, key in enumerate(chain):
            node = self.nodes.get(key)
            if node is None:
                node = _Node(parent, depth, self._clock)
                self.nodes[key] = node
                if parent is not None:
                    self.nodes[parent].children += 1
            node.stamp = self._clock
            heapq.heappush(self._heap, (node.stamp, -node.depth, key))
            parent = key
        self._evict()

    def _evict(self) -> None:
        if self.capacity is None:
            return
        while len(self.nodes) > self.capacity and self._heap:
            stamp, _, key = heapq.heappop(self._heap)
            node = self.nodes.get(key)
            if node is None or node.children or node.stamp != stamp:
                continue  # stale entry: evicted, not a leaf any more, or touched since
            del self.nodes[key]
            self.evictions += 1
            if node.parent is not None and node.parent in self.nodes:
                par = self.nodes[node.parent]
                par.children -= 1
                if par.children == 0:
                    heapq.heappush(self._heap, (par.stamp, -par.depth, node.parent))

    def check_integrity(self) -> None:
        """Every cached block's parent is cached and child counts add up."""
        counts: dict[int, int] = {}
        for node in self.nodes.values():
            if node.parent is not None:
                assert node.parent in self.nodes, "a cached block lost its prefix"
                counts[node.parent] = counts.get(node.parent, 0) + 1
        for key, node in self.nodes.items():
            assert node.children == counts.get(key, 0), f"child count of {key}"


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

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate(
    records: Sequence[TraceRecord], capacity_bytes: int | None, block_bytes: int
) -> SimResult:
    """Replay `records` through a ChainLRU of `capacity_bytes`; one block = one hash id."""
    cap_blocks = None if capacity_bytes is None else capacity_bytes // block_bytes
    cache = ChainLRU(cap_blocks)
    prompt = hits = 0
    for rec in records:
        chain = full_blocks(rec)
        prompt += rec.input_len
        hits += cache.lookup(chain) * MOONCAKE_BLOCK_TOKENS
        cache.insert(chain)
    return SimResult(capacity_bytes, cap_blocks, prompt, hits, cache.evictions)
