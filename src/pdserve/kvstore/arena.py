"""Arena: the store's host memory, one numpy uint8 buffer allocated once, never per block.

The buffer is cut into equal *extents*; an extent serves slots of one size (one block size, i.e.
one KV layout) and is split into `extent_bytes // slot_bytes` slots. Extents are handed to a
slot size when it first needs room and go back to the free pool only when empty and another
size asks (`reclaim`). With one model per store (the normal case) every extent ends up serving
its block size. Pages are faulted in on first write, so RSS grows with use, up to the capacity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


class Slot(NamedTuple):
    extent: int
    index: int
    nbytes: int


@dataclass
class _Extent:
    """Slots of one extent: indices below `fresh` were handed out at least once; the freed
    ones wait in `free`. Memory is O(slots in use), never O(slots per extent): a tiny slot
    size (a 1-byte "block") must not cost a list of millions of indices."""

    fresh: int = 0
    free: list[int] = field(default_factory=list)
    used: int = 0


@dataclass
class _SizeClass:
    slot_bytes: int
    slots_per_extent: int
    extents: dict[int, _Extent] = field(default_factory=dict)

    def has_free(self, ext: _Extent) -> bool:
        return bool(ext.free) or ext.fresh < self.slots_per_extent


class Arena:
    def __init__(self, capacity_bytes: int, extent_bytes: int) -> None:
        if extent_bytes <= 0 or capacity_bytes < extent_bytes:
            raise ValueError(
                f"capacity ({capacity_bytes} B) must hold at least one extent ({extent_bytes} B)"
            )
        self.extent_bytes = extent_bytes
        self.num_extents = capacity_bytes // extent_bytes
        self.capacity_bytes = self.num_extents * extent_bytes
        self.buffer = np.empty(self.capacity_bytes, dtype=np.uint8)  # the only allocation
        self._free_extents = list(range(self.num_extents - 1, -1, -1))
        self._classes: dict[int, _SizeClass] = {}
        self.used_bytes = 0

    # ----------------------------------------------------------------- slots
    def alloc(self, slot_bytes: int) -> Slot | None:
        """A free slot of `slot_bytes`, taking a free extent if needed; None when full."""
        if not 0 < slot_bytes <= self.extent_bytes:
            return None
        cls = self._classes.get(slot_bytes)
        if cls is None:
            cls = self._classes[slot_bytes] = _SizeClass(
                slot_bytes, self.extent_bytes // slot_bytes
            )
        extent = next((e for e, x in cls.extents.items() if cls.has_free(x)), None)
        if extent is None:
            if not self._free_extents:
                return None
            extent = self._free_extents.pop()
            cls.extents[extent] = _Extent()
        ext = cls.extents[extent]
        if ext.free:
            index = ext.free.pop()
        else:
            index, ext.fresh = ext.fresh, ext.fresh + 1
        ext.used += 1
        self.used_bytes += slot_bytes
        return Slot(extent, index, slot_bytes)

    def free(self, slot: Slot) -> None:
        ext = self._classes[slot.nbytes].extents[slot.extent]
        ext.free.append(slot.index)
        ext.used -= 1
        if ext.used == 0:  # empty: forget its indices (they are all free again)
            ext.free.clear()
            ext.fresh = 0
        self.used_bytes -= slot.nbytes

    def view(self, slot: Slot) -> np.ndarray:
        """The slot's bytes (a writable view into the arena)."""
        start = slot.extent * self.extent_bytes + slot.index * slot.nbytes
        return self.buffer[start : start + slot.nbytes]

    # ----------------------------------------------------------------- extents
    def reclaim(self, keep: int) -> bool:
        """Return one empty extent of a size class other than `keep` to the free pool."""
        for size, cls in self._classes.items():
            if size == keep:
                continue
            for extent, ext in cls.extents.items():
                if ext.used == 0:
                    del cls.extents[extent]
                    self._free_extents.append(extent)
                    return True
        return False

    def extent_counts(self) -> dict[int, int]:
        """slot size -> extents it holds."""
        return {size: len(cls.extents) for size, cls in self._classes.items()}
