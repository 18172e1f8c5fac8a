"""Remote-tier objects: a page with tierkv's own metadata in front of it, in one object.

One object per block, named ``key_prefix + block_key.hex()``. Mooncake checks neither what
it stores nor who stored it, so every object carries tierkv's own metadata in a header in
front of the page bytes, in the same object (one put, one get, never torn apart)::

    fixed  magic "TKVR" | version u16 | flags u16 | header_len u32 | page_len u64 |
           page checksum u64 | block key 32 | parent key 32 | model version 32
    then   namespace (u16 length + UTF-8) | layout JSON (u16 length) | token ids (u32 length)
    then   xxh3-64 of all header bytes before it (u64)
    page   page_len bytes, the page exactly as in every other tier

Decoding checks everything it can from the object alone; :class:`~tierkv.cluster.remote.RemoteTier`
then compares the decoded metadata with what the request expects.
"""
from __future__ import annotations

import functools
import struct
from dataclasses import dataclass

import torch
import xxhash

from ..checksum import page_checksum
from ..layout import PageLayout

MAGIC = b"TKVR"
FORMAT_VERSION = 1
_FIXED = struct.Struct("<4sHHIQQ32s32s32s")
_U16, _U32, _U64 = struct.Struct("<H"), struct.Struct("<I"), struct.Struct("<Q")
MAX_NAMESPACE_BYTES = 1024
MAX_LAYOUT_BYTES = 1024
MAX_TOKEN_BYTES = 1 << 20
_MAX_HEADER = _FIXED.size + 8 + 8 + MAX_NAMESPACE_BYTES + MAX_LAYOUT_BYTES + MAX_TOKEN_BYTES


class BadObject(Exception):
    """An object that fails verification (internal: turned into a counted miss)."""


@dataclass(frozen=True)
class RemoteMeta:
    """What travels with a page: enough to verify it without asking anyone."""

    key: bytes
    parent: bytes
    model_version: str  # 64 hex characters
    namespace: str
    tokens: bytes  # the block's token ids, little-endian int32
    checksum: int  # tierkv.checksum.page_checksum(key, page)


@dataclass(frozen=True)
class RemotePage:
    meta: RemoteMeta
    page: torch.Tensor  # [L, 2, B, H, D], a fresh CPU tensor


@dataclass(frozen=True)
class RemotePutResult:
    published: int  # objects written by this call
    skipped: int  # already in the remote store
    failed: int  # not written (tier down, store full, error): the caller keeps going


def encode_object(meta: RemoteMeta, layout: PageLayout, page: torch.Tensor) -> bytes:
    """Header + page bytes of one remote object."""
    data = page.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    ns, lay = meta.namespace.encode("utf-8"), layout_info(layout)[1]
    if len(ns) > MAX_NAMESPACE_BYTES or len(meta.tokens) > MAX_TOKEN_BYTES:
        raise ValueError("namespace or token ids too long for a remote object header")
    tail = _U16.pack(len(ns)) + ns + _U16.pack(len(lay)) + lay + _U32.pack(len(meta.tokens)) + meta.tokens
    header_len = _FIXED.size + len(tail) + 8
    fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, 0, header_len, len(data), meta.checksum, meta.key, meta.parent,
                        bytes.fromhex(meta.model_version))
    header = fixed + tail
    return header + _U64.pack(xxhash.xxh3_64_intdigest(header)) + data


@functools.lru_cache(maxsize=64)
def layout_info(layout: PageLayout) -> tuple[int, bytes]:
    """Page size and canonical JSON of ``layout`` (computed once: both sit on every fetch)."""
    return layout.page_bytes, layout.to_json().encode("utf-8")


def decode_object(blob: bytes, layout: PageLayout) -> RemotePage:
    """Parse and check one object (header checksum, lengths, layout, page checksum).
    Raises BadObject. Checks against the request (key, scope, tokens) are the caller's.
    The layout must equal this store's byte for byte (canonical JSON): anything else is a miss."""
    page_bytes, layout_json = layout_info(layout)
    view = memoryview(blob)
    if len(view) < _FIXED.size + 8:
        raise BadObject(f"object of {len(view)} bytes is shorter than a header")
    magic, version, _flags, header_len, page_len, checksum, key, parent, mv = _FIXED.unpack_from(view, 0)
    if magic != MAGIC:
        raise BadObject("wrong magic")
    if version != FORMAT_VERSION:
        raise BadObject(f"format version {version}, this tierkv reads {FORMAT_VERSION}")
    if not _FIXED.size + 8 <= header_len <= _MAX_HEADER:
        raise BadObject(f"header length {header_len} out of range")
    if len(view) != header_len + page_len:
        raise BadObject(f"object is {len(view)} bytes, header says {header_len + page_len}")
    (want,) = _U64.unpack_from(view, header_len - 8)
    if xxhash.xxh3_64_intdigest(view[: header_len - 8]) != want:
        raise BadObject("header checksum mismatch")
    pos = _FIXED.size
    try:
        (n,) = _U16.unpack_from(view, pos)
        namespace = str(view[pos + 2 : pos + 2 + n], "utf-8")
        pos += 2 + n
        (n,) = _U16.unpack_from(view, pos)
        stored_layout = bytes(view[pos + 2 : pos + 2 + n])
        pos += 2 + n
        (n,) = _U32.unpack_from(view, pos)
        tokens = bytes(view[pos + 4 : pos + 4 + n])
        pos += 4 + n
    except (struct.error, ValueError) as e:
        raise BadObject(f"undecodable header: {e}") from None
    if pos != header_len - 8:
        raise BadObject("header fields do not fill the header")
    if stored_layout != layout_json or page_len != page_bytes:
        raise BadObject(f"page of layout {stored_layout[:200]!r}, this store holds {layout_json.decode()}")
    # One copy, into memory the tensor owns (the blob belongs to the client call).
    page = torch.frombuffer(bytearray(view[header_len:]), dtype=torch.uint8).view(layout.torch_dtype).view(layout.shape)
    if page_checksum(key, page) != checksum:
        raise BadObject("page checksum mismatch")
    meta = RemoteMeta(key=key, parent=parent, model_version=mv.hex(), namespace=namespace, tokens=tokens,
                      checksum=checksum)
    return RemotePage(meta, page)
