"""Rebuild a home's index from its segments: the index is a cache of the segments.

Every slot of a format-2 segment carries its slot record (segments.py): the block key and the
index's own record for the page, written and fsynced with the page before the index commit.
So when the index is damaged or lost, :func:`rebuild_index`

1. takes the home lock (nobody else may have the home open);
2. takes the home's layout from a record of it (:func:`home_layout`), never from a count of
   segments, and quarantines segments whose header is damaged or of another layout or codec;
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

import json
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
from .codec import DEFAULT_CODEC
from .errors import CodecMismatchError, IndexDamagedError, IndexReadError, LayoutMismatchError, NotFoundError
from .home.lock import HomeLock
from .index import BlockRecord, Index, peek_meta
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


def _read_headers(home: Path) -> tuple[list[tuple[int, Path, SegmentHeader]], list[tuple[Path, str]]]:
    """Segments whose header reads, and (path, why) of those whose header is damaged."""
    good: list[tuple[int, Path, SegmentHeader]] = []
    damaged: list[tuple[Path, str]] = []
    for seg_id, path in _segments(home):
        try:
            good.append((seg_id, path, read_header(path)))
        except (SegmentFormatError, OSError) as e:
            damaged.append((path, str(e)))
    return good, damaged


def _recorded_meta(home: Path, name: str) -> str | None:
    """A value of the (possibly damaged) index's meta, or None where it cannot be read."""
    try:
        return peek_meta(home / "index", name)
    except (IndexDamagedError, IndexReadError):
        return None


def home_layout(home: Path, headers: list[tuple[int, Path, SegmentHeader]]) -> tuple[PageLayout, str, str]:
    """(layout, page codec, where the layout came from) of the store at ``home``.

    Issue #34, item 7: the layout was the majority of the segments' headers, so one own
    segment beside two foreign ones rebuilt the home as the foreign layout (its own segment
    renamed ``.bad``; the home no longer opened with its real layout). A count of files is
    not a record: the layout comes from, in order,

    1. the index's recorded layout and codec (index meta), when the damaged index still
       reads that far;
    2. for a daemon's ``HOME/layouts/<id>``, the directory's name (the daemon named it
       after the layout; ``find_layouts`` skips a directory whose name is not its layout's);
       the codec then from its segments, which must agree;
    3. only where neither exists (a root store whose index is gone): the segments, and only
       when every readable one names the same layout and codec. Any disagreement is refused
       (LayoutMismatchError naming each layout found): with no record, choosing one would
       be a guess, and a wrong guess quarantines the home's own pages.

    Rejected: always refusing without a record (the common repair, an index lost with only
    the home's own segments, would then need the layout typed in by hand)."""
    from .home.directory import LAYOUTS_DIR, layout_id

    found = Counter((h.layout.to_json(), h.page_codec) for _, _, h in headers)
    seen = ", ".join(f"{n} segment(s) of {lo} codec {c}" for (lo, c), n in found.most_common()) or "none"
    raw = _recorded_meta(home, "layout")
    try:
        recorded = None if raw is None else PageLayout.from_dict(json.loads(raw))
    except (ValueError, TypeError, KeyError):  # damage inside the record: no record
        recorded = None
    codec = _recorded_meta(home, "page_codec") if recorded is not None else None
    by_name = home.name if home.parent.name == LAYOUTS_DIR else None
    if recorded is not None:
        layout, source = recorded, "the index's recorded layout"
        if by_name is not None and layout_id(layout) != by_name:
            raise LayoutMismatchError(f"{home}: its index records layout {layout_id(layout)} but its directory "
                                      f"is named for {by_name}", hint="move the store to HOME/layouts/"
                                      f"{layout_id(layout)} (or out of layouts/), then run verify --repair again")
    elif by_name is not None:
        mine = [h for _, _, h in headers if layout_id(h.layout) == by_name]
        if not mine:
            raise NotFoundError(f"{home} holds no readable segment of its layout {by_name} (found: {seen})",
                                hint="check --home; nothing was changed")
        layout, source = mine[0].layout, f"the directory name {by_name}"
    else:
        if len({lo for lo, _ in found}) > 1:
            raise LayoutMismatchError(
                f"{home}: the index is gone with its record of the layout, and the segments name different "
                f"layouts ({seen}); refusing to guess which is the home's", hint="move the segments of the other "
                "layouts out of HOME/segments (`tierkv` reads each one's layout from its header), then run "
                "verify --repair again; nothing was changed")
        layout, source = headers[0][2].layout, "its segments (all of one layout)"
    if codec is None:
        codecs = {h.page_codec for _, _, h in headers if h.layout == layout}
        if len(codecs) > 1:
            raise CodecMismatchError(f"{home}: the segments of layout {layout_id(layout)} name different page "
                                     f"codecs ({', '.join(sorted(codecs))}) and no index records the home's",
                                     hint="move the segments of the other codec out of HOME/segments, then run "
                                     "verify --repair again; nothing was changed")
        codec = codecs.pop() if codecs else DEFAULT_CODEC
    return layout, codec, source


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
        readable, damaged = _read_headers(home)
        if not readable:
            raise NotFoundError(f"{home} holds no readable segment to rebuild an index from",
                                hint="check --home; the damaged index (if any) is left where it is")
        # Decided before any file is renamed: a refusal changes nothing.
        layout, codec, source = home_layout(home, readable)
        log.warning("rebuilding %s as layout %s, codec %s (from %s)", home, layout.to_json(), codec, source)
        headers = [(i, p, h) for i, p, h in readable if (h.layout, h.page_codec) == (layout, codec)]
        if not headers:
            raise NotFoundError(f"{home} holds no readable segment of its layout {layout.to_json()} codec {codec} "
                                f"(from {source})", hint="check --home; nothing was changed")
        for path, why in damaged:
            _quarantine(path, why)
        for _, path, h in readable:
            if (h.layout, h.page_codec) != (layout, codec):
                _quarantine(path, f"layout {h.layout.to_json()} codec {h.page_codec} is not the home's "
                                  f"{layout.to_json()} codec {codec} (from {source})")
        quarantined = len(readable) - len(headers) + len(damaged)
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
            idx.put_meta("page_codec", codec)
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
