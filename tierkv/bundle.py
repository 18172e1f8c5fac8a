"""Bundles: one named prefix as a portable file (``tierkv export`` / ``tierkv import``).

A bundle is one zstd frame (with zstd's content checksum) holding, in order::

    magic      8 bytes   b"TKVBUNDL"
    version    u32 LE    BUNDLE_VERSION
    header_len u32 LE    length of the JSON header (at most MAX_HEADER_BYTES)
    header     JSON      BundleHeader: layout, model version, namespace, counts, last key, manifest
    tokens     int32 LE  ``header.tokens`` token ids (whole blocks only)
    per block  page bytes (``layout.page_bytes``, native little-endian) + u64 LE xxh3_64(page bytes)
    end        8 bytes   b"TKVBEND\\0" + u64 LE block count
    signature  (version 2, optional) b"TKVBSIG\\0" + Ed25519 public key (32) + signature (64)
               of SIGNED_DOMAIN + SHA-256 of every byte above (magic through end marker)

No pickle: the header is JSON and everything else is raw little-endian arrays, so a bundle
is readable without running code from it. Import trusts nothing in the file: it checks the
magic, version, layout, every page checksum, the token count, that the block keys derived
from the token ids end at the recorded last key, the end marker and the signature, all
*before* it stores a single page (a first pass, :func:`check_bundle`, reads the whole file
and records a BLAKE2b digest of each page); the second pass re-checks each page against that
digest as it stores it, so a file changed in between cannot slip in other pages.

Checksums prove only that the file is intact: a forged page with a valid checksum reads
like a real one. Whether to trust the pages at all is the importer's decision
(:mod:`tierkv.transfer`: a signature by a trusted key, or a spot check against the model).

Bounds (a hostile file must not make the reader allocate what it declares): the header is
at most MAX_HEADER_BYTES of JSON nested at most MAX_JSON_DEPTH deep, at most MAX_TOKENS
token ids, pages of at most MAX_PAGE_BYTES, and the declared layout must be the importing
store's before any page is read. Pages are read straight into a chunk buffer of at most
CHUNK_BYTES (one page when pages are larger), so an import holds one chunk in flight.

This module is the format (writer, reader, checks; the header, markers and bounds are in
:mod:`tierkv.bundle_format`); :mod:`tierkv.transfer` exports a
store's prefix into it and imports it back. Pages are exported through leases (the store API
reads pages only that way), a window of blocks at a time. Rejected: reading segment files
directly (bypasses leases and checksums, and does not work through a daemon).
"""
from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import numpy as np
import torch
import zstandard

from .bundle_format import (  # every name re-exported: tierkv.bundle is the format's public module
    _U32, _U64, BUNDLE_VERSION, END, FORMAT, MAGIC, MAX_HEADER_BYTES, MAX_JSON_DEPTH, MAX_PAGE_BYTES, MAX_TOKENS, SIG,  # noqa: F401
    SIGNED_DOMAIN, BundleError, BundleHeader, _check_byteorder, page_digest,
)
from .errors import InvalidTokensError, LayoutMismatchError, NotFoundError
from .identity import as_token_array, block_keys
from .layout import PageLayout
from .tiers.segments import fsync_dir

CHUNK_BYTES = 64 << 20  # pages in flight per put
PUT_CHUNK_BLOCKS = 64


def _page_bytes(page: torch.Tensor) -> np.ndarray:
    return page.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)


# ---- writing -----------------------------------------------------------------------------
Signer = Callable[[bytes], tuple[bytes, bytes]]  # message -> (public key, signature)


class _Hashing:
    """A writer that hashes what passes through it (the signed content)."""

    def __init__(self, w: Any) -> None:
        self.w = w
        self.sha = hashlib.sha256()

    def write(self, data: Any) -> None:
        self.sha.update(data)
        self.w.write(data)


def write_bundle(path: Path, header: BundleHeader, tokens: np.ndarray, pages: Iterator[torch.Tensor],
                 signer: Signer | None = None) -> int:
    """Write a bundle to ``path`` (via a temp file, fsynced, then renamed, so a failed
    export never leaves a half bundle under the final name), signed by ``signer`` when one
    is given (:meth:`tierkv.signing.Keyring.sign`). Returns the file size."""
    _check_byteorder()
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    raw = header.to_json()
    try:
        with open(tmp, "wb") as fh:
            cctx = zstandard.ZstdCompressor(level=3, write_checksum=True)
            with cctx.stream_writer(fh, closefd=False) as zw:
                w = _Hashing(zw)
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
                if signer is not None:
                    public, signature = signer(SIGNED_DOMAIN + w.sha.digest())
                    zw.write(SIG + public + signature)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # the bundle appears under its name only when complete and durable
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


# ---- reading -----------------------------------------------------------------------------
@dataclass(frozen=True)
class VerifiedBundle:
    """What a full first pass over a bundle established (:func:`check_bundle`)."""

    header: BundleHeader
    tokens: np.ndarray
    content_sha256: bytes
    page_digests: tuple[bytes, ...]  # BLAKE2b-128 of each page, for the second pass
    signer: bytes | None  # the public key whose signature verified; None: unsigned
    path: Path  # the file checked: a later pass re-reads it against page_digests

    def pages(self) -> Iterator[tuple[int, torch.Tensor]]:
        """A second pass over the pages, as :meth:`BundleReader.iter_pages` chunks, each page
        checked against the first pass's digest (BundleError if the file changed since)."""
        with BundleReader(self.path, self.header.layout) as r:
            if r.header != self.header or not np.array_equal(r.tokens, self.tokens):
                raise BundleError(f"{self.path} changed since it was checked")
            yield from r.iter_pages(digests=self.page_digests)


def page_blake(data: Any) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class BundleReader:
    """Streams a bundle: ``header`` and ``tokens`` on open, then :meth:`iter_pages`.
    Every read checks what it can; damage raises BundleError. With ``layout``, a bundle of
    another page layout is refused (LayoutMismatchError) before any page is read."""

    def __init__(self, path: Path, layout: PageLayout | None = None) -> None:
        _check_byteorder()
        self.path = Path(path)
        self.sha = hashlib.sha256()  # of the content, as read (the signed bytes)
        self.signer: bytes | None = None
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
            if version not in (1, BUNDLE_VERSION):
                raise BundleError(f"bundle format version {version}; this tierkv reads versions 1-{BUNDLE_VERSION}",
                                  hint="import it with the tierkv version that exported it")
            self.version = version
            (n,) = _U32.unpack(head[12:16])
            if n > MAX_HEADER_BYTES:
                raise BundleError(f"bundle header of {n} bytes exceeds {MAX_HEADER_BYTES}")
            self.header = BundleHeader.from_json(self._read(n, "header"))
            if layout is not None and self.header.layout != layout:
                raise LayoutMismatchError(
                    f"the bundle holds pages of layout {self.header.layout.to_json()}, the store holds {layout.to_json()}",
                    hint="import into a home of the same model and block size (or a fresh --home)")
            tokens = np.empty(self.header.tokens, dtype="<i4")
            self._read_into(memoryview(tokens).cast("B"), "token ids")
            self.tokens = tokens
        except BaseException:
            self.close()
            raise

    def _read_into(self, view: memoryview, what: str) -> None:
        """Fill ``view`` from the stream (no intermediate copies: a declared size is
        allocated once, by the caller, after it was checked)."""
        got = 0
        try:
            while got < len(view):
                k = self._r.readinto(view[got:])
                if not k:
                    raise BundleError(f"{self.path} is truncated (in the {what})")
                got += k
        except zstandard.ZstdError as e:
            raise BundleError(f"{self.path} is damaged (zstd: {e})") from e
        self.sha.update(view)

    def _read(self, n: int, what: str) -> bytes:
        buf = bytearray(n)
        self._read_into(memoryview(buf), what)
        return bytes(buf)

    def check_tokens(self) -> None:
        """The token ids hash as recorded and key, block by block, to the recorded last key."""
        h = self.header
        if hashlib.sha256(self.tokens).hexdigest() != h.tokens_sha256:
            raise BundleError("the token ids do not match the header's SHA-256")
        try:
            keys = block_keys(self.tokens, h.scope, h.layout.block_size)
        except InvalidTokensError as e:
            raise BundleError(f"the token ids are not valid ({e.message})") from e
        if len(keys) != h.blocks or keys[-1].hex() != h.last_block_key:
            raise BundleError("the block keys derived from the token ids do not end at the recorded last key")

    def chunk_blocks(self) -> int:
        """Pages per chunk: at most PUT_CHUNK_BLOCKS and CHUNK_BYTES (at least one)."""
        return max(1, min(PUT_CHUNK_BLOCKS, CHUNK_BYTES // self.header.layout.page_bytes))

    def iter_pages(self, chunk_blocks: int | None = None,
                   digests: tuple[bytes, ...] | list[bytes] | None = None) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(start_block, pages[n, *layout.shape])`` chunks, each page checked
        against its checksum (and, with ``digests``, against the first pass's digest of
        it); then check the end marker, the signature trailer and that nothing follows.
        Each chunk is a new tensor (the caller may keep it)."""
        layout = self.header.layout
        pb = layout.page_bytes
        n_blocks = self.header.blocks
        per = chunk_blocks or self.chunk_blocks()
        tail = bytearray(8)
        for start in range(0, n_blocks, per):
            k = min(per, n_blocks - start)
            buf = torch.empty((k, pb), dtype=torch.uint8)
            arr = buf.numpy()
            for j in range(k):
                i = start + j
                self._read_into(memoryview(arr[j]), f"page {i}")
                self._read_into(memoryview(tail), f"checksum of page {i}")
                (digest,) = _U64.unpack(tail)
                if page_digest(arr[j]) != digest:
                    raise BundleError(f"page {i} of {self.path} fails its checksum")
                if digests is not None and page_blake(arr[j]) != digests[i]:
                    raise BundleError(f"page {i} of {self.path} changed since it was checked",
                                      hint="do not modify a bundle while it is imported")
            yield start, buf.view(layout.torch_dtype).view(k, *layout.shape)
        end = self._read(16, "end marker")
        if end[:8] != END or _U64.unpack(end[8:])[0] != n_blocks:
            raise BundleError(f"{self.path} has a bad end marker")
        content = self.sha.digest()
        self._read_trailer(content)

    def _read_trailer(self, content: bytes) -> None:
        trailer = bytearray(8 + 32 + 64)
        got = 0
        try:
            while got < len(trailer):
                k = self._r.readinto(memoryview(trailer)[got:])
                if not k:
                    break
                got += k
            extra = self._r.read(1)  # also makes zstd verify the frame's content checksum
        except zstandard.ZstdError as e:
            raise BundleError(f"{self.path} is damaged (zstd: {e})") from e
        if got == 0 and not extra:
            return  # unsigned
        if extra or got != len(trailer) or trailer[:8] != SIG or self.version < 2:
            raise BundleError(f"{self.path} has data after its end marker that is not a signature")
        from .signing import verify_signature

        public, signature = bytes(trailer[8:40]), bytes(trailer[40:])
        if not verify_signature(public, signature, SIGNED_DOMAIN + content):
            raise BundleError(f"the signature of {self.path} does not verify: the bundle was altered after it "
                              "was signed, or the signature is forged", hint="get the bundle again from its source")
        self.signer = public

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


def check_bundle(path: Path, layout: PageLayout | None = None) -> VerifiedBundle:
    """Read the whole bundle and check everything (BundleError on any damage, a bad
    signature included; LayoutMismatchError for another ``layout``). Keeps no page: a
    second pass (:meth:`VerifiedBundle.pages`) re-reads them against these digests."""
    with BundleReader(path, layout) as r:
        r.check_tokens()
        digests: list[bytes] = []
        for _, pages in r.iter_pages():
            flat = pages.view(pages.shape[0], -1).view(torch.uint8)
            for j in range(pages.shape[0]):
                digests.append(page_blake(flat[j].numpy()))
        return VerifiedBundle(r.header, r.tokens, r.sha.digest(), tuple(digests), r.signer, Path(path))


def verify_bundle(path: Path, layout: PageLayout | None = None) -> BundleHeader:
    """Read the whole bundle and check everything; raises BundleError on any damage."""
    return check_bundle(path, layout).header
