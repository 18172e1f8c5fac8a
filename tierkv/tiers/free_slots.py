"""Where the disk tier puts its next page: the lowest-numbered segment of the page's model
version that has a free slot (below the tier's segment limit), and in it the lowest free
slot. That is the rule ``DiskTier.alloc`` always had; it used to find them by sorting every
segment and scanning each segment's slot range, per page: 1.2 ms an allocation with 3,000
full segments (3 GiB of 4 KiB slots, or 48 GiB of 64 KiB ones), so a put of 256 blocks spent
a third of a second under the store lock, and more as the tier grew.

:class:`SegmentRooms` keeps, per model version, a min-heap of the ids of segments that may
have room, and per segment a min-heap of its free slot indices: O(log n) per allocation and
free. Heaps are checked lazily: an entry for a segment that has since filled up, gone, or
been replaced by another model version's segment under the same id is dropped when it comes
to the top. A segment's ``used`` set stays the truth (claims at open write it directly); the
heaps are rebuilt from it on the first allocation after :meth:`reset`.
"""
from __future__ import annotations

import heapq

from .disk_files import Segment


class SegmentRooms:
    """Free slots of a disk tier's segments, lowest segment id and index first."""

    def __init__(self, segs: dict[int, Segment], segment_pages: int) -> None:
        self._segs = segs  # the tier's own dict: segments come and go there
        self._segment_pages = segment_pages
        self._by_version: dict[str, list[int]] | None = None  # model version -> heap of segment ids
        self._free: dict[int, list[int]] = {}  # segment id -> heap of free indices (built on first use)

    def pages(self, seg: Segment) -> int:
        """How many pages ``seg`` takes: the smaller of its own size and the tier's current
        segment size, as the tier always counted."""
        return min(seg.header.segment_pages, self._segment_pages)

    def room(self, seg: Segment) -> bool:
        """Whether ``seg`` takes another page."""
        return len(seg.used) < self.pages(seg)

    def reset(self) -> None:
        """Segments' ``used`` sets were changed behind these heaps (claims at open)."""
        self._by_version = None
        self._free.clear()

    def _build(self) -> dict[str, list[int]]:
        by_version: dict[str, list[int]] = {}
        for seg_id, seg in self._segs.items():
            if self.room(seg):
                by_version.setdefault(seg.header.model_version, []).append(seg_id)
        for heap in by_version.values():
            heapq.heapify(heap)
        self._by_version = by_version
        return by_version

    def take(self, model_version: str, limit: int) -> tuple[int, int] | None:
        """Mark used, and return, the lowest free slot ``(segment id, index)`` in the
        lowest segment of ``model_version`` below ``limit``; None when there is none (the
        tier then makes a segment: :meth:`added`)."""
        by_version = self._by_version if self._by_version is not None else self._build()
        heap = by_version.get(model_version)
        while heap:
            seg_id = heap[0]
            if seg_id >= limit:
                return None  # the lowest is above the limit: all are
            seg = self._segs.get(seg_id)
            if seg is None or seg.header.model_version != model_version or not self.room(seg):
                heapq.heappop(heap)  # stale: gone, another version's under this id, or full
                continue
            free = self._free.get(seg_id)
            if free is None:
                free = self._free[seg_id] = [i for i in range(seg.header.segment_pages) if i not in seg.used]
            index = heapq.heappop(free)
            seg.used.add(index)
            if not self.room(seg):
                heapq.heappop(heap)  # full now (it is the top: nothing else fills segments)
            return seg_id, index
        return None

    def added(self, seg_id: int) -> None:
        """A segment was made (its ``used`` set says which slots it starts with)."""
        self._free.pop(seg_id, None)
        seg = self._segs[seg_id]
        if self._by_version is not None and self.room(seg):
            heapq.heappush(self._by_version.setdefault(seg.header.model_version, []), seg_id)

    def freed(self, seg_id: int, index: int) -> None:
        """``index`` of a segment that stays was freed (already out of its ``used`` set)."""
        seg = self._segs[seg_id]
        free = self._free.get(seg_id)
        if free is not None:
            heapq.heappush(free, index)
        if self._by_version is not None and len(seg.used) + 1 == self.pages(seg):
            # It was full, so no heap entry is live for it: it has room again.
            heapq.heappush(self._by_version.setdefault(seg.header.model_version, []), seg_id)

    def dropped(self, seg_id: int) -> None:
        """A segment was deleted (its heap entries go stale; its free list goes now, since a
        new segment may take its id)."""
        self._free.pop(seg_id, None)

    def check_integrity(self) -> None:
        """Every segment with room is reachable from its version's heap, and every built free
        list is exactly its segment's free slots."""
        for seg_id, free in self._free.items():
            seg = self._segs[seg_id]
            assert set(free) == set(range(seg.header.segment_pages)) - seg.used, f"segment {seg_id}: free list stale"
        if self._by_version is None:
            return
        for seg_id, seg in self._segs.items():
            if self.room(seg):
                assert seg_id in self._by_version.get(seg.header.model_version, ()), f"segment {seg_id} with room unlisted"
