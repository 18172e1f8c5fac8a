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

Parts of the tier live beside it: disk_files.py (segment file names, locations, the scan and
quarantine at open), disk_reads.py (the read paths and read health) and disk_records.py
(slot records).
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
from .disk_files import SEG_RE, SEG_SHIFT, Segment, SegmentFiles, location, split_location  # SEG_*: re-exported
from .disk_reads import DiskReads
from .disk_rooms import SegmentRooms
from .disk_records import rewrite_records, write_run_records
from .diskio import BounceBuffer, KvikioFiles, probe_kvikio, probe_odirect, pwrite_all
from .segments import SegmentHeader, create_segment

log = logging.getLogger(__name__)
DEGRADED_RETRY_S = 30.0
# Slot records for a write: the bodies, or a function that gives them once the pages are written.
SlotBodies = Union[Sequence[bytes], Callable[[], Sequence[bytes]]]
RUN_BYTES = 8 << 20  # largest single transfer: a few times dd's bs=4M, bounded staging memory


class DiskTier(SegmentFiles, DiskReads):
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
        self._dir_dev = os.stat(self.dir).st_dev  # see page_missing
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
        self._segs: dict[int, Segment] = {}
        self._rooms = SegmentRooms(self._segs, self.segment_pages)  # where the next page goes
        self.quarantined_segments = 0  # damaged or foreign segments moved aside at open
        self._fd_lock = threading.Lock()
        self._read_fds: dict[int, int] = {}
        self._reader_pool: ThreadPoolExecutor | None = None  # DiskReads.read_many's threads
        self._local = threading.local()
        self.degraded_reason: str | None = None
        self._degraded_until = 0.0
        # Read health (note_read_error): a read I/O error is a miss, never a deletion.
        self.read_degraded_reason: str | None = None
        self.read_errors = 0
        self.odirect = odirect and probe_odirect(self.dir)
        self.direct_reads = direct_reads and self.odirect  # see StoreConfig.direct_reads
        self._kvikio, kv_path = probe_kvikio()
        self._cufiles = KvikioFiles(self._kvikio)
        self.read_path = kv_path or ("posix-odirect" if self.direct_reads else "posix-buffered")
        log.info("disk tier %s: read path %s", self.dir, self.read_path)
        self._scan()

    # ---- slots ---------------------------------------------------------------------
    @property
    def capacity_slots(self) -> int:
        return self.max_segments * self.segment_pages

    @property
    def num_used(self) -> int:
        return sum(len(s.used) for s in self._segs.values())

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
        return sum(len(seg.used) for seg_id, seg in self._segs.items() if seg_id >= self.segment_limit)

    @property
    def used_bytes(self) -> int:
        return self.num_used * self.page_bytes

    def file_bytes(self) -> int:
        return sum(s.header.file_bytes() for s in self._segs.values())

    def claim(self, loc: int, model_version: str) -> bool:
        """Mark ``loc`` used while rebuilding from the index; False if it cannot hold a page
        of ``model_version`` (segment missing, retagged, or too short)."""
        seg_id, index = split_location(loc)
        seg = self._segs.get(seg_id)
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
        found = self._rooms.take(model_version, self.segment_limit)  # tierkv/tiers/disk_rooms.py
        if found is not None:
            return location(*found)
        header = SegmentHeader(self.layout, model_version, self.segment_pages, page_codec=self.codec.name)
        if len(self._segs) >= self.segment_limit:
            return None  # as many files as the limit allows (some above it, not yet emptied)
        for seg_id in range(self.segment_limit):
            if seg_id not in self._segs:
                self._guard_io(create_segment, self._path(seg_id), header)
                self._segs[seg_id] = Segment(header, self._path(seg_id), {0})
                self._rooms.added(seg_id)
                return location(seg_id, 0)
        return None

    def reclaim_empty(self) -> int:
        """Delete segments no index entry points to (after the claims at open)."""
        empty = [seg_id for seg_id, seg in self._segs.items() if not seg.used]
        for seg_id in empty:
            self._drop_segment(seg_id)
        return len(empty)

    def _drop_segment(self, seg_id: int) -> None:
        with self._fd_lock:
            fd = self._read_fds.pop(seg_id, None)
            if fd is not None:
                os.close(fd)
        self._cufiles.drop(seg_id)
        path = self._segs.pop(seg_id).path
        self._rooms.dropped(seg_id)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            # A failing file system: the slot is free all the same (the index no longer
            # points here); the empty file is reclaimed at the next open.
            log.warning("could not delete empty segment %s: %s", path, e)

    def free(self, loc: int) -> None:
        seg_id, index = split_location(loc)
        seg = self._segs.get(seg_id)
        if seg is None or index not in seg.used:
            raise ValueError(f"disk location {loc:#x} freed but not in use")
        seg.used.remove(index)
        if not seg.used:
            # Last page gone: give the space back (the index no longer points here).
            self._drop_segment(seg_id)
        else:
            self._rooms.freed(seg_id, index)
            self._wipe_record(seg, index)

    def _wipe_record(self, seg: Segment, index: int) -> None:
        """Zero a freed slot's record, so that rebuilding the index from the segments does not
        bring the block back. Not synced and best effort: a crash or an I/O error here at
        worst lets a rebuild restore a deleted block, whose bytes are still exactly its key's."""
        if not seg.header.record_bytes:
            return
        try:
            fd = os.open(seg.path, os.O_WRONLY)
            try:
                os.pwrite(fd, bytes(seg.header.record_bytes), seg.header.record_offset(index))
            finally:
                os.close(fd)
        except OSError as e:
            log.warning("could not wipe the record of a freed slot in %s: %s", seg.path.name, e)

    # ---- bytes ---------------------------------------------------------------------
    def _offset(self, loc: int) -> tuple[Segment, int, int]:
        seg_id, index = split_location(loc)
        seg = self._segs[seg_id]
        return seg, seg_id, seg.header.data_offset + index * self.slot_bytes

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

    def _runs(self, locs: list[int], run_bytes: int = RUN_BYTES) -> list[list[int]]:
        """Positions of ``locs`` grouped into runs of consecutive slots of one segment (at
        most ``run_bytes`` each), so that a transfer is one large request, as dd's bs=4M is."""
        per_run = max(1, run_bytes // self.slot_bytes)
        order = sorted(range(len(locs)), key=lambda k: locs[k])
        runs: list[list[int]] = []
        for k in order:
            if runs and locs[k] == locs[runs[-1][-1]] + 1 and len(runs[-1]) < per_run \
                    and split_location(locs[k])[0] == split_location(locs[runs[-1][0]])[0]:
                runs[-1].append(k)
            else:
                runs.append([k])
        return runs

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
        runs = self._runs(locs)
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
                    seg, seg_id, off = self._offset(locs[run[0]])
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
                write_run_records(self._offset, locs, runs, records() if callable(records) else records, buffered)
            if self.fsync:
                # One fdatasync per segment covers its pages and records (one inode).
                for seg_id, fd in touched.items():
                    os.fdatasync(buffered.get(seg_id, fd))
        finally:
            for fd in [*touched.values(), *buffered.values()]:
                os.close(fd)

    def update_records(self, records: Sequence[tuple[int, bytes]]) -> None:
        """:func:`~tierkv.tiers.disk_records.rewrite_records` of this tier's segments."""
        rewrite_records(self._segs, records, self.fsync)

    def _staging(self, nbytes: int) -> tuple[BounceBuffer, BounceBuffer]:
        """This thread's two aligned write buffers, grown to at least ``nbytes`` each."""
        pair = getattr(self._local, "staging", None)
        if pair is None or pair[0].nbytes < nbytes:
            if pair is not None:
                for b in pair:
                    b.close()
            pair = self._local.staging = (BounceBuffer(nbytes), BounceBuffer(nbytes))
        return pair

    def segment_files(self) -> list[Path]:
        return [s.path for s in self._segs.values()]

    def describe(self) -> dict[str, object]:
        return {
            "read_path": self.read_path,
            "page_codec": self.codec.name,
            "segments": len(self._segs),
            "segment_pages": self.segment_pages,
            "limit_segments": self.segment_limit,
            "file_bytes": self.file_bytes(),
            "degraded": self.degraded_reason,
            "read_degraded": self.read_degraded_reason,
            "read_errors": self.read_errors,
            "quarantined_segments": self.quarantined_segments,
        }

    def check_integrity(self) -> None:
        for seg_id, seg in self._segs.items():
            assert seg.path.exists(), f"segment {seg_id} missing on disk"
            assert all(0 <= i < seg.header.segment_pages for i in seg.used), "slot outside segment"
            assert seg.used, f"empty segment {seg_id} not reclaimed"
        self._rooms.check_integrity()

    def close(self) -> None:
        if self._reader_pool is not None:
            self._reader_pool.shutdown(wait=True)
            self._reader_pool = None
        with self._fd_lock:
            for fd in self._read_fds.values():
                os.close(fd)
            self._read_fds.clear()
        self._cufiles.close()
