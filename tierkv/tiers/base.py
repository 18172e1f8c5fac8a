"""What every tier shares: a fixed set of page slots and the one object that hands them out.

A tier owns *bytes*, not blocks: it never decides what to evict. The store's manager
decides which block lives where and calls ``alloc``/``free`` in pairs; the allocator
checks every transition (double free, freeing a slot never handed out) and
``check_integrity`` recomputes its totals.
"""
from __future__ import annotations

import heapq
from enum import Enum
from typing import Callable


class TierName(str, Enum):
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"


# A tier's name as a plain str: the key of tierkv.core.blocks.Block.loc. A TierName member finds
# the same dict entry, but through the slower path of a str subclass (~30 ns a lookup), and
# ``.value`` is a descriptor call: the hot paths look the key up here once.
TIER_KEY: dict[TierName, str] = {t: t.value for t in TierName}


class SlotAllocator:
    """Free/used sets of slot ids ``0..capacity-1``.

    Only :meth:`alloc` and :meth:`free` move a slot between the two sets. Lowest free slot
    first, so a store that shrinks leaves its high slots (and disk segments) empty.

    ``limit`` (at most ``capacity``; :meth:`set_limit`) bounds what :meth:`alloc` hands out:
    fewer than ``limit`` slots in use, and only slots below ``limit``. So the slots at or
    above it are never touched anew (a daemon's layouts share one budget: each layout's tier
    is mapped at the whole budget and used up to its limit). Slots above a lowered limit stay
    used until freed; ``on_release_above(slot)`` is then called, so the tier can give the
    slot's memory back.

    ``on_new_high(slot)`` is called when a slot above every slot handed out before is
    handed out (lowest first, so that is how far the tier's use has grown): the tier
    faults its memory in a little ahead of that mark (tierkv/tiers/memory.py).
    """

    def __init__(self, capacity: int, on_release_above: Callable[[int], None] | None = None,
                 on_new_high: Callable[[int], None] | None = None) -> None:
        if capacity < 0:
            raise ValueError("capacity must be >= 0")
        self.capacity = capacity
        self.limit = capacity
        self.on_release_above = on_release_above
        self.on_new_high = on_new_high
        self.high = 0  # one past the highest slot ever handed out
        # A min-heap: alloc pops the lowest free slot, free pushes one back, each O(log n).
        # (A list kept sorted was re-sorted by free() whenever a freed slot was higher than
        # the lowest free one: O(n) per free, and a daemon's commit freeing 256 of 500,000
        # staging slots in ascending order spent ~100 ms there, on its event loop.)
        self._free: list[int] = list(range(capacity))  # ascending: already a heap
        self._used: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def is_used(self, slot: int) -> bool:
        return slot in self._used

    def set_limit(self, limit: int) -> None:
        """Hand out at most ``limit`` slots, all below ``limit``, from now on (the slots in
        use stay: the caller evicts those at or above it, :meth:`used_above_limit`)."""
        if not 0 <= limit <= self.capacity:
            raise ValueError(f"limit must be in [0, {self.capacity}], got {limit}")
        self.limit = limit

    def used_above_limit(self) -> list[int]:
        """Used slots at or above the limit, lowest first."""
        return sorted(s for s in self._used if s >= self.limit) if self.limit < self.capacity else []

    def alloc_below_limit(self) -> int | None:
        """The lowest free slot below the limit, now used, whatever the count (for moving a
        block from above the limit: the caller frees its old slot at once); None if none."""
        if not self._free or self._free[0] >= self.limit:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        if slot >= self.high:
            self._new_high(slot)
        return slot

    def alloc(self) -> int | None:
        """A free slot id, now used; ``None`` when the tier is full or at its limit (the
        caller evicts)."""
        if not self._free or (self.limit < self.capacity
                              and (len(self._used) >= self.limit or self._free[0] >= self.limit)):
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        if slot >= self.high:
            self._new_high(slot)
        return slot

    def _new_high(self, slot: int) -> None:
        self.high = slot + 1
        if self.on_new_high is not None:
            self.on_new_high(slot)

    def reuse(self, slot: int) -> int | None:
        """``free(slot)`` then ``alloc()``, as one step (an eviction that makes room for a
        new block): ``slot`` itself, with nothing moved, when no other slot is free and the
        limit allows it (a full tier: every such eviction), else the two calls."""
        if not self._free and slot < self.limit and len(self._used) <= self.limit:
            return slot
        self.free(slot)
        return self.alloc()

    def claim(self, slot: int) -> None:
        """Mark a specific slot used (rebuilding state from the durable index at open)."""
        if slot in self._used or not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} cannot be claimed (used or out of range)")
        self._used.add(slot)
        self._free.remove(slot)
        heapq.heapify(self._free)
        if slot >= self.high:
            self._new_high(slot)

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} freed but not in use")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)
        if slot >= self.limit and self.on_release_above is not None:
            self.on_release_above(slot)

    def used_slots(self) -> set[int]:
        return set(self._used)

    def check_integrity(self) -> None:
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate slot in free list"
        h = self._free
        assert all(h[(i - 1) // 2] <= h[i] for i in range(1, len(h))), "free list is not a heap"
        assert not (free & self._used), "slot both free and used"
        assert free | self._used == set(range(self.capacity)), "slot lost from both sets"
        assert 0 <= self.limit <= self.capacity, "limit outside the slots"
        assert all(s < self.high for s in self._used), "a used slot above the high mark"
