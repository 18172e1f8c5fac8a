"""The disk tier's segment files: their names, where a slot's bytes lie in them, and the scan
at open that takes stock of them (quarantining a damaged or foreign one).

A location is ``segment_id << 20 | index``.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..codec import PageCodec
from ..layout import PageLayout
from .segments import SegmentFormatError, SegmentHeader, create_segment, read_header

log = logging.getLogger("tierkv.tiers.disk")  # one logger for the whole disk tier
SEG_SHIFT = 20
SEG_RE = re.compile(r"^seg-(\d{6})\.safetensors$")


def location(seg_id: int, index: int) -> int:
    return (seg_id << SEG_SHIFT) | index


def split_location(loc: int) -> tuple[int, int]:
    return loc >> SEG_SHIFT, loc & ((1 << SEG_SHIFT) - 1)


@dataclass
class Segment:
    header: SegmentHeader
    path: Path
    used: set[int] = field(default_factory=set)
    size: int | None = None  # the file's size, as the first claim at open saw it (DiskTier.claim)


class SegmentFiles:
    """The segment files of one directory. It owns the segment table (``segments``: which
    files exist, by id) and changes it only in :meth:`create` and :meth:`drop`; the slots a
    segment has in ``used`` are the disk tier's to hand out and take back. Scans the
    directory when made: a damaged or foreign segment is quarantined, the rest are taken."""

    def __init__(self, directory: Path, layout: PageLayout, codec: PageCodec) -> None:
        self.dir = directory
        self._dir_dev = os.stat(directory).st_dev  # see page_missing
        self.layout = layout
        self.codec = codec
        self.slot_bytes = codec.slot_bytes
        self.segments: dict[int, Segment] = {}
        self.quarantined = 0  # damaged or foreign segments moved aside at open
        self._scan()

    def path(self, seg_id: int) -> Path:
        return self.dir / f"seg-{seg_id:06d}.safetensors"

    def create(self, seg_id: int, header: SegmentHeader) -> Segment:
        """Make segment ``seg_id``'s file (durable before it is used) and add it, slot 0 used.
        Raises OSError (the tier turns it into DiskWriteError)."""
        create_segment(self.path(seg_id), header)
        seg = self.segments[seg_id] = Segment(header, self.path(seg_id), {0})
        return seg

    def drop(self, seg_id: int) -> None:
        """Forget segment ``seg_id`` and delete its file (the index points at none of its
        slots any more). A failing delete is logged: the empty file is reclaimed at the next
        open."""
        path = self.segments.pop(seg_id).path
        try:
            path.unlink(missing_ok=True)
        except OSError as e:
            log.warning("could not delete empty segment %s: %s", path, e)

    def offset(self, loc: int) -> tuple[Segment, int, int]:
        """``loc``'s segment, its id, and the byte offset of its slot in the file."""
        seg_id, index = split_location(loc)
        seg = self.segments[seg_id]
        return seg, seg_id, seg.header.data_offset + index * self.slot_bytes

    def runs(self, locs: list[int], run_bytes: int) -> list[list[int]]:
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

    def page_missing(self, loc: int) -> bool:
        """Whether the slot at ``loc`` is provably gone: its segment file is missing or too
        short to hold it (a truncated segment). Anything else (an error while checking, the
        segments directory no longer being the file system it was at open) is no proof."""
        seg_id, index = split_location(loc)
        seg = self.segments.get(seg_id)
        if seg is None:
            return True
        try:
            if os.stat(self.dir).st_dev != self._dir_dev:
                return False  # the file system was unmounted underneath: not proof of anything
            size = os.stat(seg.path).st_size
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return size < seg.header.data_offset + (index + 1) * self.slot_bytes

    def file_bytes(self) -> int:
        return sum(s.header.file_bytes() for s in self.segments.values())

    def _scan(self) -> None:
        for p in sorted(self.dir.iterdir()):
            if p.suffix == ".tmp":
                p.unlink(missing_ok=True)  # a segment whose creation never finished
                continue
            m = SEG_RE.match(p.name)
            if not m:
                continue
            try:
                header = read_header(p)
                if header.layout != self.layout:
                    # The index (checked first) says which layout this home holds: a segment
                    # of another one is damaged or foreign; its blocks become misses.
                    raise SegmentFormatError(f"{p}: holds layout {header.layout.to_json()}, the home {self.layout.to_json()}")
                if header.page_codec != self.codec.name:  # pages of another form: foreign too
                    raise SegmentFormatError(f"{p}: holds pages of codec {header.page_codec}, the home {self.codec.name}")
            except SegmentFormatError as e:
                self._quarantine(p, str(e))
                continue
            self.segments[int(m.group(1))] = Segment(header, p)

    def _quarantine(self, path: Path, reason: str) -> None:
        """Move a damaged segment aside (``*.bad``, kept for inspection), count it, log it."""
        log.warning("quarantining segment %s: %s", path.name, reason)
        self.quarantined += 1
        try:
            path.rename(path.with_name(path.name + ".bad"))
        except OSError as e:  # a read-only home: the segment is left in place, and unused
            log.error("could not move %s aside: %s", path.name, e)
