"""Disk segment files: preallocated, 4 KiB-aligned page slots inside a valid safetensors file.

    [8-byte LE header length N][JSON header, padded with spaces][slot records][slot 0][slot 1]...

8 + N is a multiple of 4096, the slot-record area is a multiple of 4096, and every slot is
``layout.slot_bytes`` (the page rounded up to 4 KiB), so each page read is one aligned,
contiguous read that O_DIRECT and GPUDirect accept. The header declares two ``U8`` tensors,
``records`` and ``pages`` (``[segment_pages, slot_bytes]``), and metadata naming the format
version, layout and model version, so any safetensors reader can open a segment (see
docs/format.md). A segment holds the pages of exactly one model version, so invalidating a
model version frees whole segments.

Format 2 makes the index a cache of the segments: slot ``i``'s **record** (at
``records_offset + i * record_bytes``) carries what the index holds for its page (key,
parent, model version, namespace, priority, checksum, token ids), written with the page and
made durable by the same fdatasync, so ``tierkv verify --repair`` can rebuild a lost index.
A record has its own magic, version and checksum; the header carries a checksum of itself, so
one flipped byte makes the segment quarantined instead of misread. Rejected: the record in
the slack after the page (pages that are a 4 KiB multiple have none, and growing the slot
would break the host tier's whole-slot O_DIRECT reads and every run of consecutive slots).
Format 1 segments (no records, no header checksum) stay readable; they cannot be rebuilt.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import xxhash

from ..codec import DEFAULT_CODEC, PageCodec
from ..layout import ALIGN, PageLayout, round_up

FORMAT = "tierkv-segment"
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
_U64 = struct.Struct("<Q")
# Slot record: magic, record version, body length, xxh3-64 of the body; then the body.
RECORD_MAGIC = b"TKVS"
RECORD_VERSION = 1
_REC_HEAD = struct.Struct("<4sBHQ")
# The body is the block key and the index's own record encoding (tierkv.index.BlockRecord:
# 96 fixed bytes, the namespace, the token ids). Namespaces longer than this many UTF-8
# bytes get no slot record (the page is still stored; it cannot be rebuilt from the segment).
MAX_NAMESPACE_BYTES = 256
_BLOCK_RECORD_FIXED = 96


def record_bytes(layout: PageLayout) -> int:
    """Bytes reserved for each slot's record in a format-2 segment of ``layout``."""
    return round_up(_REC_HEAD.size + 32 + _BLOCK_RECORD_FIXED + MAX_NAMESPACE_BYTES + 4 * layout.block_size, 64)


@dataclass(frozen=True)
class SegmentHeader:
    layout: PageLayout
    model_version: str
    segment_pages: int
    format_version: int = FORMAT_VERSION
    # How the pages are stored (tierkv/codec.py). Named in the metadata (``page_codec``) only
    # when not ``none``, so that the headers of exact homes are unchanged.
    page_codec: str = DEFAULT_CODEC

    @cached_property
    def codec(self) -> PageCodec:
        return PageCodec(self.page_codec, self.layout)

    @property
    def page_bytes(self) -> int:
        """Bytes of one stored page."""
        return self.codec.stored_bytes

    @property
    def slot_bytes(self) -> int:
        return self.codec.slot_bytes

    @property
    def record_bytes(self) -> int:
        """Bytes of one slot record (0: a format-1 segment without records)."""
        return record_bytes(self.layout) if self.format_version >= 2 else 0

    @cached_property
    def records_offset(self) -> int:  # cached: every page read computes its offset from it
        return len(encode_header(self))

    @property
    def records_area(self) -> int:
        return round_up(self.segment_pages * self.record_bytes, ALIGN) if self.record_bytes else 0

    @cached_property  # cached: a claim at open and every page's offset ask for it
    def data_offset(self) -> int:
        return self.records_offset + self.records_area

    def record_offset(self, index: int) -> int:
        return self.records_offset + index * self.record_bytes

    def file_bytes(self) -> int:
        return self.data_offset + self.segment_pages * self.slot_bytes


def _body(h: SegmentHeader) -> dict:
    meta = {
        "format": FORMAT,
        "format_version": str(h.format_version),
        "layout": h.layout.to_json(),
        "model_version": h.model_version,
        "segment_pages": str(h.segment_pages),
        "page_bytes": str(h.page_bytes),
        "slot_bytes": str(h.slot_bytes),
    }
    if h.page_codec != DEFAULT_CODEC:
        meta["page_codec"] = h.page_codec
    pages = h.segment_pages * h.slot_bytes
    if h.format_version < 2:
        return {"__metadata__": meta, "pages": {"dtype": "U8", "shape": [h.segment_pages, h.slot_bytes],
                                                "data_offsets": [0, pages]}}
    area = round_up(h.segment_pages * record_bytes(h.layout), ALIGN)
    meta["record_bytes"] = str(record_bytes(h.layout))
    return {
        "__metadata__": meta,
        "records": {"dtype": "U8", "shape": [area], "data_offsets": [0, area]},
        "pages": {"dtype": "U8", "shape": [h.segment_pages, h.slot_bytes], "data_offsets": [area, area + pages]},
    }


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _header_checksum(body: dict) -> str:
    """xxh3-64 of the canonical header without its own checksum field."""
    meta = {k: v for k, v in body["__metadata__"].items() if k != "header_checksum"}
    return xxhash.xxh3_64_hexdigest(_canonical({**body, "__metadata__": meta}))


def encode_header(h: SegmentHeader) -> bytes:
    body = _body(h)
    if h.format_version >= 2:
        body["__metadata__"]["header_checksum"] = _header_checksum(body)
    raw = _canonical(body)
    # safetensors allows trailing spaces in the header; padding puts the data on a 4 KiB boundary.
    n = round_up(8 + len(raw), ALIGN) - 8
    return _U64.pack(n) + raw + b" " * (n - len(raw))


class SegmentFormatError(ValueError):
    pass


def read_header(path: Path) -> SegmentHeader:
    """Parse and validate a segment's header; raises SegmentFormatError."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise SegmentFormatError(f"{path}: shorter than a header")
        (n,) = _U64.unpack(head)
        if n > 1 << 20 or (8 + n) % ALIGN:
            raise SegmentFormatError(f"{path}: header length {n} is not a tierkv header")
        raw = f.read(n)
    try:
        body = json.loads(raw)
        meta = body["__metadata__"]
        if meta.get("format") != FORMAT:
            raise SegmentFormatError(f"{path}: not a tierkv segment")
        version = int(meta["format_version"])
        if version not in READABLE_VERSIONS:
            raise SegmentFormatError(f"{path}: format version {meta['format_version']}, this tierkv reads {READABLE_VERSIONS}")
        if version >= 2 and meta.get("header_checksum") != _header_checksum(body):
            raise SegmentFormatError(f"{path}: header checksum mismatch (a damaged header)")
        header = SegmentHeader(
            layout=PageLayout.from_dict(json.loads(meta["layout"])),
            model_version=str(meta["model_version"]),
            segment_pages=int(meta["segment_pages"]),
            format_version=version,
            page_codec=str(meta.get("page_codec", DEFAULT_CODEC)),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, SegmentFormatError):
            raise
        raise SegmentFormatError(f"{path}: damaged header ({e})") from e
    if header.records_offset != 8 + n:
        raise SegmentFormatError(f"{path}: header does not match its own length")
    return header


# ---- slot records ------------------------------------------------------------------------
def encode_record(body: bytes, capacity: int) -> bytes | None:
    """A slot record of ``body`` padded to ``capacity`` bytes; None when it does not fit."""
    if _REC_HEAD.size + len(body) > capacity:
        return None
    head = _REC_HEAD.pack(RECORD_MAGIC, RECORD_VERSION, len(body), xxhash.xxh3_64_intdigest(body))
    return (head + body).ljust(capacity, b"\0")


class RecordState:
    EMPTY = "empty"  # never written, or wiped when the slot was freed
    CORRUPT = "corrupt"  # magic present but version, length or checksum wrong
    OK = "ok"


def decode_record(raw: bytes) -> tuple[str, bytes]:
    """(RecordState, body) of a slot record read from disk."""
    if len(raw) < _REC_HEAD.size or raw[:4] != RECORD_MAGIC:
        return (RecordState.EMPTY if not any(raw[:_REC_HEAD.size]) else RecordState.CORRUPT), b""
    _, version, length, digest = _REC_HEAD.unpack_from(raw)
    body = raw[_REC_HEAD.size : _REC_HEAD.size + length]
    if version != RECORD_VERSION or len(body) != length or xxhash.xxh3_64_intdigest(body) != digest:
        return RecordState.CORRUPT, b""
    return RecordState.OK, bytes(body)


def create_segment(path: Path, header: SegmentHeader) -> None:
    """Write a new segment durably: temp file, header, preallocated body (records zeroed),
    fsync, rename, fsync of the directory (a file's fsync does not persist its directory entry)."""
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        raw = encode_header(header)
        os.pwrite(fd, raw, 0)
        total = header.file_bytes()
        try:
            os.posix_fallocate(fd, 0, total)
        except OSError as e:
            if e.errno not in (95, 22):  # EOPNOTSUPP / EINVAL: file system without fallocate
                raise
            os.ftruncate(fd, total)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
