"""Bundles: one named prefix as a portable file (``tierkv export`` / ``tierkv import``).

A bundle is one zstd frame (with zstd's content checksum) holding, in order::

    magic      8 bytes   b"TKVBUNDL"
    version    u32 LE    BUNDLE_VERSION
    header_len u32 LE    length of the JSON header (at most MAX_HEADER_BYTES)
    header     JSON      BundleHeader: layout, model version, namespace, counts, last key, manifest
    tokens     int32 LE  ``header.tokens`` token ids (whole blocks only)
    per block  page bytes (``layout.page_bytes``, native little-endian) + u64 LE xxh3_64(page bytes)
    end        8 bytes   b"TKVBEND\\0" + u64 LE block count

No pickle: the header is JSON and everything else is raw little-endian arrays, so a bundle
is readable without running code from it. Import trusts nothing in the file: it checks the
magic, version, layout, every page checksum, the token count, that the block keys derived
from the token ids end at the recorded last key, and the end marker, all *before* it stores
a single page (a first pass reads the whole file); the second pass re-checks each page as
it stores it, in case the file changed in between.

This module is the format (writer, reader, checks); :mod:`tierkv.transfer` exports a
store's prefix into it and imports it back. Pages are exported through leases (the store API
reads pages only that way), a window of blocks at a time. Rejected: reading segment files
directly (bypasses leases and checksums, and does not work through a daemon).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Iterator

import numpy as np
import torch
import xxhash
import zstandard

from .errors import InvalidTokensError, NotFoundError, TierKVError
from .identity import Scope, as_token_array, block_keys
from .layout import PageLayout
from .tiers.segments import fsync_dir

MAGIC = b"TKVBUNDL"
END = b"TKVBEND\0"
BUNDLE_VERSION = 1
FORMAT = "tierkv-bundle"
MAX_HEADER_BYTES = 16 << 20
MAX_TOKENS = 1 << 28  # 1 GiB of token ids: far beyond any context, small enough to read at once
PUT_CHUNK_BLOCKS = 64
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")


class BundleError(TierKVError, ValueError):
    """The file is not a bundle this tierkv can read, or it is damaged."""

    default_hint = "export the prefix again; the bundle is damaged, truncated or not a tierkv bundle"


@dataclass(frozen=True)
class BundleHeader:
    layout: PageLayout
    model_version: str
    namespace: str
    tokens: int
    blocks: int
    last_block_key: str
    tokens_sha256: str
    name: str
    manifest: dict[str, Any]
    extra_keys: tuple[str, ...] = ()
    created_at: str = ""
    checksum: str = "xxh3_64"

    @property
    def scope(self) -> Scope:
        return Scope(self.model_version, self.namespace, self.extra_keys)

    def to_json(self) -> bytes:
        return json.dumps({
            "format": FORMAT, "layout": self.layout.to_dict(), "model_version": self.model_version,
            "namespace": self.namespace, "extra_keys": list(self.extra_keys), "tokens": self.tokens,
            "blocks": self.blocks, "page_bytes": self.layout.page_bytes, "byteorder": "little",
            "last_block_key": self.last_block_key, "tokens_sha256": self.tokens_sha256, "name": self.name,
            "manifest": self.manifest, "created_at": self.created_at, "checksum": self.checksum,
        }, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "BundleHeader":
        try:
            d = json.loads(raw)
            if d.get("format") != FORMAT:
                raise BundleError(f"header names format {d.get('format')!r}, not {FORMAT!r}")
            layout = PageLayout.from_dict(d["layout"])
            h = cls(
                layout=layout, model_version=str(d["model_version"]), namespace=str(d["namespace"]),
                tokens=int(d["tokens"]), blocks=int(d["blocks"]), last_block_key=str(d["last_block_key"]),
                tokens_sha256=str(d["tokens_sha256"]), name=str(d["name"]), manifest=dict(d["manifest"]),
                extra_keys=tuple(str(x) for x in d.get("extra_keys", [])), created_at=str(d.get("created_at", "")),
                checksum=str(d["checksum"]),
            )
            h.scope  # validates the model version and namespace
            if d.get("byteorder") != "little" or int(d["page_bytes"]) != layout.page_bytes:
                raise BundleError("header page size or byte order does not match its layout")
        except BundleError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise BundleError(f"damaged bundle header ({type(e).__name__}: {e})") from e
        if h.checksum != "xxh3_64":
            raise BundleError(f"unknown page checksum {h.checksum!r}")
        if not 0 <= h.tokens <= MAX_TOKENS or h.blocks * layout.block_size != h.tokens or h.blocks < 1:
            raise BundleError(f"header says {h.tokens} tokens in {h.blocks} blocks of {layout.block_size}")
        return h


def _check_byteorder() -> None:
    if sys.byteorder != "little":  # pages are written in native order, which the format fixes
        raise BundleError("bundles are little-endian; this host is big-endian", hint="export/import on a little-endian host")


def page_digest(data: np.ndarray | bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _page_bytes(page: torch.Tensor) -> np.ndarray:
    return page.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)


# ---- writing -----------------------------------------------------------------------------
def write_bundle(path: Path, header: BundleHeader, tokens: np.ndarray, pages: Iterator[torch.Tensor]) -> int:
    """Write a bundle to ``path`` (via a temp file, fsynced, then renamed, so a failed
    export never leaves a half bundle under the final name). Returns the file size."""
    _check_byteorder()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    raw = header.to_json()
    try:
        with open(tmp, "wb") as fh:
            cctx = zstandard.ZstdCompressor(level=3, write_checksum=True)
            with cctx.stream_writer(fh, closefd=False) as w:
                w.write(MAGIC + _U32.pack(BUNDLE_VERSION) + _U32.pack(len(raw)) + raw)
                w.write(as_token_array(tokens).tobytes())
                n = 0
                for page in pages:
                    data = _page_bytes(page)
                    if data.nbytes != header.layout.page_bytes:
                        raise BundleError(f"page {n} has {data.nbytes} bytes, the layout says {header.layout.page_bytes}")
                    w.write(data)
                    w.write(_U64.pack(page_digest(data)))
                    n += 1
                if n != header.blocks:
                    raise BundleError(f"wrote {n} pages for {header.blocks} blocks")
                w.write(END + _U64.pack(n))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # the bundle appears under its name only when complete and durable
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# ---- reading -----------------------------------------------------------------------------
class BundleReader:
    """Streams a bundle: ``header`` and ``tokens`` on open, then :meth:`iter_pages`.
    Every read checks what it can; damage raises BundleError."""

    def __init__(self, path: Path) -> None:
        _check_byteorder()
        self.path = Path(path)
        try:
            self._fh: IO[bytes] = open(self.path, "rb")
        except FileNotFoundError:
            raise NotFoundError(f"no bundle at {self.path}", hint="check the path given to `tierkv import`") from None
        self._r = zstandard.ZstdDecompressor().stream_reader(self._fh, read_across_frames=False)
        try:
            head = self._read(16, "header")
            if head[:8] != MAGIC:
                raise BundleError(f"{self.path} is not a tierkv bundle (bad magic)")
            (version,) = _U32.unpack(head[8:12])
            if version != BUNDLE_VERSION:
                raise BundleError(f"bundle format version {version}; this tierkv reads version {BUNDLE_VERSION}",
                                  hint="import it with the tierkv version that exported it")
            (n,) = _U32.unpack(head[12:16])
            if n > MAX_HEADER_BYTES:
                raise BundleError(f"bundle header of {n} bytes exceeds {MAX_HEADER_BYTES}")
            self.header = BundleHeader.from_json(self._read(n, "header"))
            self.tokens = np.frombuffer(self._read(4 * self.header.tokens, "token ids"), dtype="<i4").copy()
        except BaseException:
            self.close()
            raise

    def _read(self, n: int, what: str) -> bytes:
        out = bytearray()
        try:
            while len(out) < n:
                chunk = self._r.read(n - len(out))
                if not chunk:
                    raise BundleError(f"{self.path} is truncated (in the {what})")
                out += chunk
        except zstandard.ZstdError as e:
            raise BundleError(f"{self.path} is damaged (zstd: {e})") from e
        return bytes(out)

    def check_tokens(self) -> None:
        """The token ids hash as recorded and key, block by block, to the recorded last key."""
        h = self.header
        if hashlib.sha256(self.tokens.tobytes()).hexdigest() != h.tokens_sha256:
            raise BundleError("the token ids do not match the header's SHA-256")
        try:
            keys = block_keys(self.tokens, h.scope, h.layout.block_size)
        except InvalidTokensError as e:
            raise BundleError(f"the token ids are not valid ({e.message})") from e
        if len(keys) != h.blocks or keys[-1].hex() != h.last_block_key:
            raise BundleError("the block keys derived from the token ids do not end at the recorded last key")

    def iter_pages(self, chunk_blocks: int = PUT_CHUNK_BLOCKS) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(start_block, pages[n, *layout.shape])`` chunks, each page checked
        against its checksum; then check the end marker and that nothing follows it."""
        layout = self.header.layout
        pb = layout.page_bytes
        buf: list[torch.Tensor] = []
        start = 0
        for i in range(self.header.blocks):
            data = self._read(pb + 8, f"page {i}")
            (digest,) = _U64.unpack(data[pb:])
            if page_digest(data[:pb]) != digest:
                raise BundleError(f"page {i} of {self.path} fails its checksum")
            page = torch.frombuffer(bytearray(data[:pb]), dtype=torch.uint8).view(layout.torch_dtype).view(layout.shape)
            buf.append(page)
            if len(buf) == chunk_blocks:
                yield start, torch.stack(buf)
                start += len(buf)
                buf = []
        if buf:
            yield start, torch.stack(buf)
        tail = self._read(16, "end marker")
        if tail[:8] != END or _U64.unpack(tail[8:])[0] != self.header.blocks:
            raise BundleError(f"{self.path} has a bad end marker")
        try:
            extra = self._r.read(1)  # also makes zstd verify the frame's content checksum
        except zstandard.ZstdError as e:
            raise BundleError(f"{self.path} is damaged (zstd: {e})") from e
        if extra:
            raise BundleError(f"{self.path} has data after its end marker")

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> "BundleReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_header(path: Path) -> BundleHeader:
    """The header of the bundle at ``path`` (checks magic and version only)."""
    with BundleReader(path) as r:
        return r.header


def verify_bundle(path: Path) -> BundleHeader:
    """Read the whole bundle and check everything; raises BundleError on any damage."""
    with BundleReader(path) as r:
        r.check_tokens()
        for _ in r.iter_pages():
            pass
        return r.header
