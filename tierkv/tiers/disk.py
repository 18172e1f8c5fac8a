"""The disk (NVMe) tier: page slots in preallocated safetensors segment files.

A location is ``segment_id << 20 | index``. The tier hands out and takes back slots and moves
bytes; it never decides what to evict (the store's manager does). A segment belongs to one
model version; when its last page is freed the file is deleted, so invalidating a model
version gives its disk space back to the file system.

Each written slot also gets its slot record (what the index holds for the page; see
segments.py), written beside the page and made durable by the same fdatasync; freeing a slot
wipes its record, so a rebuild of the index (tierkv.repair) does not bring the block back.

A segment whose header is damaged or foreign (a failed checksum, another layout) is
*quarantined* at open: renamed ``*.bad``, counted and logged; the rest of the home opens.

Faults: an OSError while writing or syncing marks the tier *degraded* for
``DEGRADED_RETRY_S`` (puts then skip the disk and say so) and surfaces as DiskWriteError.
After a failed fsync the data is treated as lost; the slot is never reported durable.

The tier holds two parts, each owning its state: :class:`SegmentFiles` (disk_files.py: the
segment table, file names, locations, the scan and quarantine at open) and
:class:`DiskReads` (disk_reads.py: the read paths, their descriptors and threads, read
health). The tier itself hands out slots and writes; slot records are in disk_records.py.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence, Union

import numpy as np
import torch

from ..codec import PageCodec
from ..errors import DiskReadError, DiskWriteError
from ..layout import PageLayout
from .base import TierName
from .disk_files import SEG_RE, SEG_SHIFT, SegmentFiles, location, split_location  # noqa: F401  (SEG_*: re-exported)
from .disk_reads import DiskReads
from .free_slots import SegmentRooms
from .disk_records import rewrite_records, wipe_record, write_run_records
from .diskio import BounceBuffer, probe_odirect, pwrite_all
from .segments import SegmentHeader

log = logging.getLogger(__name__)
DEGRADED_RETRY_S = 30.0
# Slot records for a write: the bodies, or a function that gives them once the pages are written.
SlotBodies = Union[Sequence[bytes], Callable[[], Sequence[bytes]]]
RUN_BYTES = 8 << 20  # largest single transfer: a few times dd's bs=4M, bounded staging memory


class DiskTier:
    name = TierName.DISK

    def __init__(
        self,
        directory: Path,
        layout: PageLayout,
        capacity_bytes: int,
        segment_pages: int,
        *,
        odirect: bool = True,
        direct_reads: bool = True,
        fsync: bool = True,
        codec: PageCodec | None = None,
    ) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        # Pages are stored in the codec's form (tierkv/codec.py): these sizes are the stored ones.
        self.codec = codec or PageCodec("none", layout)
        self.page_bytes, self.slot_bytes = self.codec.stored_bytes, self.codec.slot_bytes
        cap_slots = capacity_bytes // self.slot_bytes
        self.segment_pages = max(1, min(segment_pages, cap_slots or 1))
        self.max_segments = cap_slots // self.segment_pages
        # Segments below this id may be used (set_limit: a daemon's layouts share one
        # budget); the files of the others are evicted by the store and not made again.
        self.segment_limit = self.max_segments
        self.fsync = fsync
        self._local = threading.local()  # each thread's write staging buffers
        self.degraded_reason: str | None = None
        self._degraded_until = 0.0
        self.odirect = odirect and probe_odirect(self.dir)
        self.files = SegmentFiles(self.dir, layout, self.codec)
        # The segment table is the files'; the tier changes only the used slots in it.
        self._rooms = SegmentRooms(self.files.segments, self.segment_pages)  # where the next page goes
        # Read health (note_read_error): a read I/O error is a miss, never a deletion.
        self.reads = DiskReads(self.files, direct_reads=direct_reads and self.odirect)  # see StoreConfig.direct_reads
        log.info("disk tier %s: read path %s", self.dir, self.read_path)

    # ---- slots ---------------------------------------------------------------------
    @property
    def capacity_slots(self) -> int:
        return self.max_segments * self.segment_pages

    @property
    def num_used(self) -> int:
        return sum(len(s.used) for s in self.files.segments.values())

    @property
    def capacity_bytes(self) -> int:
        """What the tier may hold now: its limit (``capacity_slots`` is the most it can)."""
        return self.segment_limit * self.segment_pages * self.page_bytes

    def set_limit(self, limit_bytes: int) -> None:
        """Use at most ``limit_bytes`` (whole segments, at most the capacity; counted as
        ``capacity_bytes`` was given) from now on: new pages go only to segments below the
        limit, and no segment is made while as many files exist. The caller (the store)
        evicts the pages of the segments above it; a segment's file goes with its last page."""
        self.segment_limit = min(self.max_segments, max(0, limit_bytes) // self.slot_bytes // self.segment_pages)

    def over_limit(self, loc: int) -> bool:
        """Whether ``loc`` lies in a segment at or above the limit."""
        return split_location(loc)[0] >= self.segment_limit

    def used_above_limit(self) -> int:
        """Used slots in segments at or above the limit."""
        return sum(len(seg.used) for seg_id, seg in self.files.segments.items() if seg_id >= self.segment_limit)

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.page_bytes

    def file_bytes(self) -> int:
        return self.files.file_bytes()

    def claim(self, loc: int, model_version: str) -> bool:
        """Mark ``loc`` used while rebuilding from the index; False if it cannot hold a page
        of ``model_version`` (segment missing, retagged, or too short)."""
        seg_id, index = split_location(loc)
        seg = self.files.segments.get(seg_id)
        if seg is None or seg.header.model_version != model_version or index >= seg.header.segment_pages:
            return False
        if index in seg.used:
            return False
        if seg.size is None:  # once per segment: an open claims every record of each
            try:
                seg.size = seg.path.stat().st_size
            except FileNotFoundError:
                return False
            except OSError as e:
                # An I/O error says nothing about the slot; answering False would quarantine
                # (delete) every record of the segment (RELIABILITY.md case 14).
                raise DiskReadError(f"cannot check segment {seg.path}: {e}") from e
        if seg.size < seg.header.data_offset + (index + 1) * self.slot_bytes:
            return False
        seg.used.add(index)
        self._rooms.reset()
        return True

    def alloc(self, model_version: str) -> int | None:
        """A free slot in a segment of ``model_version``; creates or retags a segment when
        needed. None when the tier is full. Raises DiskWriteError if a segment cannot be made."""
        found = self._rooms.take(model_version, self.segment_limit)  # tierkv/tiers/free_slots.py
        if found is not None:
            return location(*found)
        header = SegmentHeader(self.layout, model_version, self.segment_pages, page_codec=self.codec.name)
        if len(self.files.segments) >= self.segment_limit:
            return None  # as many files as the limit allows (some above it, not yet emptied)
        for seg_id in range(self.segment_limit):
            if seg_id not in self.files.segments:
                self._guard_io(self.files.create, seg_id, header)
                self._rooms.added(seg_id)
                return location(seg_id, 0)
        return None

    def reclaim_empty(self) -> int:
        """Delete segments no index entry points to (after the claims at open)."""
        empty = [seg_id for seg_id, seg in self.files.segments.items() if not seg.used]
        for seg_id in empty:
            self._drop_segment(seg_id)
        return len(empty)

    def _drop_segment(self, seg_id: int) -> None:
        self.reads.forget(seg_id)  # no descriptor left open on a deleted file
        self.files.drop(seg_id)
        self._rooms.dropped(seg_id)

    def free(self, loc: int) -> None:
        seg_id, index = split_location(loc)
        seg = self.files.segments.get(seg_id)
        if seg is None or index not in seg.used:
            raise ValueError(f"disk location {loc:#x} freed but not in use")
        seg.used.remove(index)
        if not seg.used:
            # Last page gone: give the space back (the index no longer points here).
            self._drop_segment(seg_id)
        else:
            self._rooms.freed(seg_id, index)
            wipe_record(seg, index)

    # ---- bytes ---------------------------------------------------------------------
    @property
    def degraded(self) -> bool:
        if self.degraded_reason and time.monotonic() >= self._degraded_until:
            log.info("disk tier: retrying after degradation (%s)", self.degraded_reason)
            self.degraded_reason = None
        return self.degraded_reason is not None

    def _guard_io(self, fn, *args):  # type: ignore[no-untyped-def]
        try:
            return fn(*args)
        except OSError as e:
            reason = errno.errorcode.get(e.errno or 0, str(e))
            self.degraded_reason = reason
            self._degraded_until = time.monotonic() + DEGRADED_RETRY_S
            log.error("disk tier degraded: %s", e)
            raise DiskWriteError(f"disk tier write failed: {e}") from e

    def write_pages(self, items: list[tuple[int, torch.Tensor]], records: SlotBodies | None = None) -> None:
        """Write pages (CPU tensors of one page each, in the layout's form or the codec's stored
        form; encoded here when not stored) and, in ``records`` (one body per item,
        from ``BlockRecord.slot_body``; or a function giving them, called once the pages are
        written, so the caller can finish the records meanwhile), their slot records; make
        both durable (fdatasync per segment). Only after this returns may the index point at
        them."""
        self._guard_io(self._write_pages, items, records)

    def write_slots(self, items: list[tuple[int, memoryview]], fill: Callable[[list[int]], None],
                    records: SlotBodies | None = None) -> None:
        """As :meth:`write_pages`, from buffers the caller owns: ``items`` are ``(location,
        buffer)``, each buffer one whole slot (``slot_bytes``, 4 KiB-aligned: a device-tier
        slot, :meth:`~tierkv.tiers.memory.MemoryTier.direct_target`), and ``fill(positions)``
        fills the buffers of those positions of ``items`` just before they are written, on
        this thread, while the run before them is in flight. No staging copy: a put's pages
        go to disk from the slots its copy into memory filled (issue #31)."""
        if any(len(buf) != self.slot_bytes for _, buf in items):
            raise ValueError(f"write_slots writes whole slots of {self.slot_bytes} bytes")
        self._guard_io(self._write_pages, items, records, fill)

    def _write_pages(self, items: list[tuple[int, torch.Tensor]] | list[tuple[int, memoryview]],
                     records: SlotBodies | None = None, fill: Callable[[list[int]], None] | None = None) -> None:
        """Both writes: pages (``fill`` None) copied into staging buffers, or slots filled in
        place by ``fill`` (:meth:`write_slots`). One name for both, so the crash tests' kill
        point "disk-write" covers each."""
        touched: dict[int, int] = {}
        buffered: dict[int, int] = {}  # segment -> a plain descriptor for the slot records
        page_bytes, slot = self.page_bytes, self.slot_bytes
        to_stored = self.codec.to_stored  # pages arrive in the layout's form or already stored
        locs = [loc for loc, _ in items]
        runs = self.files.runs(locs, RUN_BYTES)
        # Double buffering: run k is copied into one staging buffer (or its slots filled)
        # while run k-1 is written by a writer thread (os.pwritev and numpy's copy both
        # release the GIL).
        staging = self._staging(max((len(r) for r in runs), default=1) * slot) if fill is None else None

        def prepare(r_i: int, run: list[int]) -> memoryview | list[memoryview]:
            """Run ``r_i``'s bytes, ready to write."""
            if staging is None:
                assert fill is not None
                fill(run)
                return [items[k][1] for k in run]  # type: ignore[misc]
            bounce = staging[r_i % 2]
            dst = bounce.tensor.numpy()
            for j, k in enumerate(run):
                page = items[k][1]
                assert isinstance(page, torch.Tensor)
                src = to_stored(page.detach()).contiguous().view(torch.uint8).reshape(-1).numpy()
                np.copyto(dst[j * slot : j * slot + page_bytes], src)
            return memoryview(bounce.mm)[: len(run) * slot]

        pending: Future[None] | None = None
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="tierkv-write") as writer:
                for r_i, run in enumerate(runs):
                    seg, seg_id, off = self.files.offset(locs[run[0]])
                    if seg_id not in touched:
                        # O_DIRECT: the pages bypass (and do not evict) the page cache; whole
                        # padded slots are written from an aligned buffer as it requires.
                        touched[seg_id] = os.open(seg.path, os.O_WRONLY | (os.O_DIRECT if self.odirect else 0))
                    data = prepare(r_i, run)
                    if pending is not None:
                        pending.result()
                    pending = writer.submit(pwrite_all, touched[seg_id], data, off)
                if pending is not None:
                    pending.result()
            if records is not None:
                write_run_records(self.files.offset, locs, runs, records() if callable(records) else records, buffered)
            if self.fsync:
                # One fdatasync per segment covers its pages and records (one inode).
                for seg_id, fd in touched.items():
                    os.fdatasync(buffered.get(seg_id, fd))
        finally:
            for fd in [*touched.values(), *buffered.values()]:
                os.close(fd)

    def update_records(self, records: Sequence[tuple[int, bytes]]) -> None:
        """:func:`~tierkv.tiers.disk_records.rewrite_records` of this tier's segments."""
        rewrite_records(self.files.segments, records, self.fsync)

    def _staging(self, nbytes: int) -> tuple[BounceBuffer, BounceBuffer]:
        """This thread's two aligned write buffers, grown to at least ``nbytes`` each."""
        pair = getattr(self._local, "staging", None)
        if pair is None or pair[0].nbytes < nbytes:
            if pair is not None:
                for b in pair:
                    b.close()
            pair = self._local.staging = (BounceBuffer(nbytes), BounceBuffer(nbytes))
        return pair

    def describe(self) -> dict[str, object]:
        return {
            "read_path": self.read_path,
            "page_codec": self.codec.name,
            "segments": len(self.files.segments),
            "segment_pages": self.segment_pages,
            "limit_segments": self.segment_limit,
            "file_bytes": self.file_bytes(),
            "degraded": self.degraded_reason,
            "read_degraded": self.reads.read_degraded_reason,
            "read_errors": self.reads.read_errors,
            "quarantined_segments": self.files.quarantined,
        }

    def check_integrity(self) -> None:
        for seg_id, seg in self.files.segments.items():
            assert seg.path.exists(), f"segment {seg_id} missing on disk"
            assert all(0 <= i < seg.header.segment_pages for i in seg.used), "slot outside segment"
            assert seg.used, f"empty segment {seg_id} not reclaimed"
        self._rooms.check_integrity()

    def close(self) -> None:
        self.reads.close()

    # ---- reads (DiskReads): the store's read API ----------------------------------------
    @property
    def read_path(self) -> str:
        """:attr:`DiskReads.read_path`."""
        return self.reads.read_path

    @property
    def reads_to_device(self) -> bool:
        """:attr:`DiskReads.reads_to_device`."""
        return self.reads.reads_to_device

    def read_into(self, loc: int, buf: memoryview) -> None:
        """:meth:`DiskReads.read_into`."""
        self.reads.read_into(loc, buf)

    def read_many(self, items: list[tuple[int, memoryview]], on_run: Callable[[list[int]], None] | None = None) -> None:
        """:meth:`DiskReads.read_many`."""
        self.reads.read_many(items, on_run)

    def read_many_to_device(self, items: list[tuple[int, torch.Tensor]],
                            on_run: Callable[[list[int]], None] | None = None) -> None:
        """:meth:`DiskReads.read_many_to_device`."""
        self.reads.read_many_to_device(items, on_run)

    def read_page(self, loc: int) -> torch.Tensor:
        """:meth:`DiskReads.read_page`."""
        return self.reads.read_page(loc)

    def staging(self, n: int) -> tuple[torch.Tensor, list[memoryview]]:
        """:meth:`DiskReads.staging`."""
        return self.reads.staging(n)

    def note_read_error(self, err: BaseException) -> None:
        """:meth:`DiskReads.note_read_error`."""
        self.reads.note_read_error(err)

    def note_read_ok(self) -> None:
        """:meth:`DiskReads.note_read_ok`."""
        self.reads.note_read_ok()

    def page_missing(self, loc: int) -> bool:
        """:meth:`SegmentFiles.page_missing`."""
        return self.files.page_missing(loc)
