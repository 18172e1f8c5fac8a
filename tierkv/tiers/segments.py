"""Disk segment files: preallocated, 4 KiB-aligned page slots inside a valid safetensors file.

    [8-byte little-endian header length N][JSON header, padded with spaces][slot 0][slot 1]...

8 + N is a multiple of 4096 and every slot is ``layout.slot_bytes`` (the page rounded up to
4 KiB), so each page read is one aligned, contiguous read that O_DIRECT and GPUDirect accept.
The header declares one ``U8`` tensor ``pages`` of shape ``[segment_pages, slot_bytes]`` and
metadata naming the format version, layout and model version, so any safetensors reader can
open a segment (see docs/format.md). A segment holds the pages of exactly one model version,
so invalidating a model version frees whole segments.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from ..layout import ALIGN, PageLayout, round_up

FORMAT = "tierkv-segment"
FORMAT_VERSION = 1
_U64 = struct.Struct("<Q")


@dataclass(frozen=True)
class SegmentHeader:
    layout: PageLayout
    model_version: str
    segment_pages: int

    @property
    def data_offset(self) -> int:
        return len(encode_header(self))

    def file_bytes(self) -> int:
        return self.data_offset + self.segment_pages * self.layout.slot_bytes


def encode_header(h: SegmentHeader) -> bytes:
    meta = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "layout": h.layout.to_json(),
        "model_version": h.model_version,
        "segment_pages": str(h.segment_pages),
        "page_bytes": str(h.layout.page_bytes),
        "slot_bytes": str(h.layout.slot_bytes),
    }
    body = {
        "__metadata__": meta,
        "pages": {
            "dtype": "U8",
            "shape": [h.segment_pages, h.layout.slot_bytes],
            "data_offsets": [0, h.segment_pages * h.layout.slot_bytes],
        },
    }
    raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    # safetensors allows trailing spaces in the header; padding puts slot 0 on a 4 KiB boundary.
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
        if int(meta["format_version"]) != FORMAT_VERSION:
            raise SegmentFormatError(f"{path}: format version {meta['format_version']}, this tierkv reads {FORMAT_VERSION}")
        header = SegmentHeader(
            layout=PageLayout.from_dict(json.loads(meta["layout"])),
            model_version=str(meta["model_version"]),
            segment_pages=int(meta["segment_pages"]),
        )
    except (ValueError, KeyError, TypeError) as e:
        if isinstance(e, SegmentFormatError):
            raise
        raise SegmentFormatError(f"{path}: damaged header ({e})") from e
    if header.data_offset != 8 + n:
        raise SegmentFormatError(f"{path}: header does not match its own length")
    return header


def create_segment(path: Path, header: SegmentHeader) -> None:
    """Write a new segment durably: temp file, header, preallocated body, fsync, rename,
    fsync of the directory (a file's fsync does not persist its directory entry)."""
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
