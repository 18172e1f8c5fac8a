"""The disk tier's segment files: their names, the slot locations in them, and the scan at
open that takes stock of them (quarantining a damaged or foreign one). :class:`SegmentFiles`
is a part of :class:`tierkv.tiers.disk.DiskTier`, which holds the state it uses.

A location is ``segment_id << 20 | index``.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..codec import PageCodec
from ..layout import PageLayout
from .segments import SegmentFormatError, SegmentHeader, read_header

log = logging.getLogger("tierkv.tiers.disk")  # the disk tier's one logger, as before the split
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
    """The segment files of one directory (a mixin of DiskTier: it owns the attributes)."""

    dir: Path
    layout: PageLayout
    codec: PageCodec
    _segs: dict[int, Segment]
    quarantined_segments: int

    # ---- layout of files -------------------------------------------------------------
    def _path(self, seg_id: int) -> Path:
        return self.dir / f"seg-{seg_id:06d}.safetensors"

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
                self.quarantine_segment(p, str(e))
                continue
            self._segs[int(m.group(1))] = Segment(header, p)

    def quarantine_segment(self, path: Path, reason: str) -> None:
        """Move a damaged segment aside (``*.bad``, kept for inspection), count it, log it."""
        log.warning("quarantining segment %s: %s", path.name, reason)
        self.quarantined_segments += 1
        try:
            path.rename(path.with_name(path.name + ".bad"))
        except OSError as e:  # a read-only home: the segment is left in place, and unused
            log.error("could not move %s aside: %s", path.name, e)
