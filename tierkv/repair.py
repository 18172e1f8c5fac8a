"""Rebuild a home's index from its segments: the index is a cache of the segments.

Every slot of a format-2 segment carries its slot record (segments.py): the block key and the
index's own record for the page, written and fsynced with the page before the index commit.
So when the index is damaged or lost, :func:`rebuild_index`

1. takes the home lock (nobody else may have the home open);
2. quarantines segments whose header is damaged or of another layout than the majority;
3. moves the old index aside (``index.damaged-<time>``: kept for inspection, never read);
4. reads every slot's record and page: a record whose own checksum fails, that does not
   decode, names another model version than its segment, or whose page fails the page
   checksum (seeded by the key) is counted as corrupt and left out: never wrong bytes;
5. writes the records into a fresh index built beside it, then moves that into place.

What the index held and the segments do not is lost: named prefixes (manifests), the
quarantine log, and priority changes made after a page was written (a block pinned later is
rebuilt with the priority it was written with). Pages of format-1 segments have no records
and are not rebuilt (counted as ``unrecoverable``); their slots are reclaimed at the next open.
A rebuild may restore a block that was deleted just before a crash (its record wipe is not
synced); its bytes are still exactly the page of its key.
"""
from __future__ import annotations

import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .blocks import Priority
from .checksum import page_checksum
from .config import StoreConfig
from .errors import IndexDamagedError, NotFoundError
from .home import HomeLock
from .index import BlockRecord, Index
from .index_check import check_index
from .layout import PageLayout
from .tiers.disk import SEG_RE, location
from .tiers.segments import RecordState, SegmentFormatError, SegmentHeader, decode_record, read_header

log = logging.getLogger(__name__)
BATCH = 1024  # records per index transaction
Progress = Callable[[int, int], None]  # (slots scanned, slots in all segments)


@dataclass(frozen=True)
class RebuildResult:
    rebuilt: int  # blocks indexed again from their slot records
    skipped: int  # slots with no record (free, or freed and wiped)
    corrupt: int  # records or pages that failed a check (left out)
    duplicates: int  # a key already rebuilt from another slot (left out; same bytes)
    unrecoverable: int  # slots of format-1 segments, which carry no records
    quarantined_segments: int
    moved_aside: str | None  # where the old index went
    layout: str  # the home's layout (JSON)

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def _segments(home: Path) -> list[tuple[int, Path]]:
    seg_dir = home / "segments"
    if not seg_dir.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in seg_dir.iterdir() if (m := SEG_RE.match(p.name)))


def _quarantine(path: Path, reason: str) -> None:
    log.warning("quarantining segment %s: %s", path.name, reason)
    path.rename(path.with_name(path.name + ".bad"))


def _read_headers(home: Path) -> tuple[list[tuple[int, Path, SegmentHeader]], int]:
    """Readable segments of the home's layout (the majority's), and how many were quarantined."""
    good: list[tuple[int, Path, SegmentHeader]] = []
    bad = 0
    for seg_id, path in _segments(home):
        try:
            good.append((seg_id, path, read_header(path)))
        except (SegmentFormatError, OSError) as e:
            _quarantine(path, str(e))
            bad += 1
    if not good:
        return [], bad
    # A home's segments share one layout and one page codec (tierkv/codec.py).
    (layout_json, codec), _ = Counter((h.layout.to_json(), h.page_codec) for _, _, h in good).most_common(1)[0]
    keep = []
    for seg_id, path, h in good:
        if (h.layout.to_json(), h.page_codec) == (layout_json, codec):
            keep.append((seg_id, path, h))
        else:
            _quarantine(path, f"layout {h.layout.to_json()} differs from the home's {layout_json}")
            bad += 1
    return keep, bad


def _scan_segment(seg_id: int, path: Path, h: SegmentHeader, counts: Counter, found: dict[bytes, BlockRecord],
                  progress: Progress | None, done: int, total: int) -> int:
    layout = h.layout
    n_tok_bytes = 4 * layout.block_size
    now = time.time()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        records = os.pread(f.fileno(), h.segment_pages * h.record_bytes, h.records_offset)
        for i in range(h.segment_pages):
            raw = records[i * h.record_bytes : (i + 1) * h.record_bytes]
            state, body = decode_record(raw)
            if state == RecordState.EMPTY:
                counts["skipped"] += 1
                continue
            try:
                if state != RecordState.OK:
                    raise ValueError("slot record checksum")
                rec = BlockRecord.from_slot_body(body)
                if (rec.model_version != h.model_version or len(rec.tokens) != n_tok_bytes
                        or rec.priority not in set(Priority)):
                    raise ValueError("slot record does not fit its segment")
                off = h.data_offset + i * h.slot_bytes  # the stored page's sizes (its codec's)
                if off + h.page_bytes > size:
                    raise ValueError("page beyond the end of a truncated segment")
                page = os.pread(f.fileno(), h.page_bytes, off)
                if page_checksum(rec.key, torch.frombuffer(bytearray(page), dtype=torch.uint8)) != rec.checksum:
                    raise ValueError("page checksum")
            except Exception as e:  # struct.error, ValueError, UnicodeDecodeError: all damage
                log.warning("slot %d of %s left out: %s", i, path.name, e)
                counts["corrupt"] += 1
                continue
            if rec.key in found:
                counts["duplicates"] += 1
                continue
            found[rec.key] = BlockRecord(rec.key, rec.parent, rec.model_version, rec.namespace, rec.priority,
                                         rec.checksum, location(seg_id, i), now, rec.tokens)
            if progress is not None and i % 256 == 0:
                progress(done + i, total)
    return h.segment_pages


def rebuild_index(home: Path, *, map_size: int | None = None, progress: Progress | None = None) -> RebuildResult:
    """Rebuild ``home``'s index from its segments (see the module docstring). Raises
    StoreLockedError when the home is open elsewhere, NotFoundError when it has no segments."""
    home = Path(home)
    lock = HomeLock(home, None)
    try:
        headers, quarantined = _read_headers(home)
        if not headers:
            raise NotFoundError(f"{home} holds no readable segment to rebuild an index from",
                                hint="check --home; the damaged index (if any) is left where it is")
        layout: PageLayout = headers[0][2].layout
        counts: Counter = Counter()
        found: dict[bytes, BlockRecord] = {}
        total = sum(h.segment_pages for _, _, h in headers)
        done = 0
        for seg_id, path, h in headers:
            if not h.record_bytes:
                counts["unrecoverable"] += h.segment_pages
                done += h.segment_pages
                continue
            done += _scan_segment(seg_id, path, h, counts, found, progress, done, total)
        if progress is not None:
            progress(total, total)

        # Build the new index beside the home (its parent has no segments/, so the pre-open
        # check sees a new index), then swap: the old one is moved aside, never deleted.
        from .store import FORMAT_VERSION

        staging = home / "index.rebuild"
        shutil.rmtree(staging, ignore_errors=True)
        idx = Index(staging / "index", map_size or StoreConfig.__dataclass_fields__["index_map_bytes"].default)
        try:
            idx.put_meta("layout", layout.to_json())
            idx.put_meta("format_version", FORMAT_VERSION)
            idx.put_meta("page_codec", headers[0][2].page_codec)
            recs = list(found.values())
            for k in range(0, len(recs), BATCH):
                idx.put_blocks(recs[k : k + BATCH])
        finally:
            idx.close()
        moved: str | None = None
        old = home / "index" / "data.mdb"
        if (home / "index").exists() and not (old.exists() and old.stat().st_size):
            shutil.rmtree(home / "index")  # nothing in it to keep
        if (home / "index").exists():
            aside = home / f"index.damaged-{time.strftime('%Y%m%dT%H%M%S')}"
            (home / "index").rename(aside)
            moved = str(aside)
        (staging / "index").rename(home / "index")
        staging.rmdir()
        result = RebuildResult(
            rebuilt=len(found), skipped=counts["skipped"], corrupt=counts["corrupt"], duplicates=counts["duplicates"],
            unrecoverable=counts["unrecoverable"], quarantined_segments=quarantined, moved_aside=moved,
            layout=layout.to_json(),
        )
        log.warning("index of %s rebuilt from its segments: %s", home, result)
        return result
    finally:
        lock.release()


def index_damaged(home: Path) -> str | None:
    """Why ``home``'s index cannot be opened (the pre-open check), or None when it can."""
    try:
        check_index(Path(home) / "index")
    except IndexDamagedError as e:
        return e.message
    return None
