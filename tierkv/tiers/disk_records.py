"""Slot records on disk: each page's record (what the index holds for it, segments.py)
written beside the page, by the disk tier's write (:func:`write_run_records`), rewritten
after a priority change (:func:`rewrite_records`) and wiped when the slot is freed
(:func:`wipe_record`). Buffered writes: records are small and
not 4 KiB-aligned, so O_DIRECT does not apply."""
from __future__ import annotations

import logging
import os
from typing import Callable, Sequence

from .disk_files import Segment, split_location
from .diskio import pwrite_all
from .segments import encode_record

log = logging.getLogger("tierkv.tiers.disk")


def write_run_records(offset_of: Callable[[int], tuple[Segment, int, int]], locs: list[int], runs: list[list[int]],
                      records: Sequence[bytes], fds: dict[int, int]) -> None:
    """The slot records of a write, one pwrite per run of consecutive slots; ``fds`` (segment
    id -> descriptor) gains the descriptors opened, which the caller syncs and closes."""
    for run in runs:
        seg, seg_id, _ = offset_of(locs[run[0]])
        size = seg.header.record_bytes
        if not size:
            continue  # a format-1 segment: no records
        if seg_id not in fds:
            fds[seg_id] = os.open(seg.path, os.O_WRONLY)
        # A body that does not fit (an over-long namespace) leaves a zeroed record: the
        # page is stored and served, only a rebuild cannot restore it.
        raw = b"".join(encode_record(records[k], size) or bytes(size) for k in run)
        pwrite_all(fds[seg_id], memoryview(raw), seg.header.record_offset(split_location(locs[run[0]])[1]))


def rewrite_records(segs: dict[int, Segment], records: Sequence[tuple[int, bytes]], fsync: bool) -> None:
    """Rewrite the slot records of pages already on disk (``(location, body)``, e.g. after
    a priority change, whose index commit came first) and sync them. Best effort: a
    failure is logged, and costs only that a rebuilt index has the old priority."""
    try:
        by_seg: dict[int, list[tuple[int, bytes]]] = {}
        for loc, body in records:
            by_seg.setdefault(split_location(loc)[0], []).append((loc, body))
        for seg_id, items in by_seg.items():
            seg = segs[seg_id]
            if not seg.header.record_bytes:
                continue
            fd = os.open(seg.path, os.O_WRONLY)
            try:
                for loc, body in items:
                    raw = encode_record(body, seg.header.record_bytes) or bytes(seg.header.record_bytes)
                    pwrite_all(fd, memoryview(raw), seg.header.record_offset(split_location(loc)[1]))
                if fsync:
                    os.fdatasync(fd)
            finally:
                os.close(fd)
    except OSError as e:
        log.warning("could not rewrite slot records: %s", e)


def wipe_record(seg: Segment, index: int) -> None:
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
