"""Store counters (the Stats RPC reads a snapshot)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class StoreStats:
    capacity_bytes: int = 0
    used_bytes: int = 0  # reserved (open puts) + stored slots
    num_blocks: int = 0
    hits: int = 0  # blocks, counted by Lookup
    misses: int = 0
    evictions: int = 0
    bytes_in: int = 0  # committed put bytes
    bytes_out: int = 0  # fetched bytes sent
    pinned_blocks: int = 0
    put_rejected: int = 0
    corrupt_puts: int = 0
    open_puts: int = 0  # begun, not yet committed / aborted / expired (service-level)
    staging_bytes: int = 0  # bytes in put/fetch staging buffers now (service-level)
    disk_capacity_bytes: int = 0  # the disk tier (0 = none), in block bytes
    disk_used_bytes: int = 0  # on disk or being written
    disk_blocks: int = 0  # blocks with a copy on disk
    disk_hits: int = 0  # of `hits`, blocks found on disk only (Lookup)
    disk_writes: int = 0  # blocks written to disk
    demotions: int = 0  # RAM copies dropped for blocks kept on disk
    promotions: int = 0  # disk-only blocks a fetch copied back into RAM
    disk_corrupt: int = 0  # block files that read back corrupt or short (then a miss)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
