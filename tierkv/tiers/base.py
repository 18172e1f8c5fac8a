"""What every tier shares: a fixed set of page slots and the one object that hands them out.

A tier owns *bytes*, not blocks: it never decides what to evict. The store's manager
decides which block lives where and calls ``alloc``/``free`` in pairs; the allocator
checks every transition (double free, freeing a slot never handed out) and
``check_integrity`` recomputes its totals.
"""
from __future__ import annotations

from enum import Enum


class TierName(str, Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


class SlotAllocator:
    """Free/used sets of slot ids ``0..capacity-1``.

    Only :meth:`alloc` and :meth:`free` move a slot between the two sets. Lowest free slot
    first, so a store that shrinks leaves its high slots (and disk segments) empty.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self._free: list[int] = list(range(capacity - 1, -1, -1))  # stack: pop() gives lowest
        self._used: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_used(self, slot: int) -> bool:
        return slot in self._used

    def alloc(self) -> int | None:
        """A free slot id, now used; ``None`` when the tier is full (the caller evicts)."""
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def claim(self, slot: int) -> None:
        """Mark a specific slot used (rebuilding state from the durable index at open)."""
        if slot in self._used or not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} cannot be claimed (used or out of range)")
        self._used.add(slot)
        self._free.remove(slot)

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} freed but not in use")
        self._used.remove(slot)
        self._free.append(slot)
        # Keep lowest-first order cheap: only re-sort when the new slot breaks it.
        if len(self._free) > 1 and self._free[-1] > self._free[-2]:
            self._free.sort(reverse=True)

    def used_slots(self) -> set[int]:
        return set(self._used)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate slot in free list"
        assert not (free & self._used), "slot both free and used"
        assert free | self._used == set(range(self.capacity)), "slot lost from both sets"
