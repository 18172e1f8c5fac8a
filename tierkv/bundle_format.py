"""The bundle format's fixed parts: its markers and bounds, the JSON header
(:class:`BundleHeader`, checked as it is parsed), its error, and the page checksum.
:mod:`tierkv.bundle` writes and reads bundles with them (and re-exports every name here)."""
from __future__ import annotations

import json
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from .errors import TierKVError
from .identity import Scope
from .json_limits import nests_deeper_than
from .layout import PageLayout

MAGIC = b"TKVBUNDL"
END = b"TKVBEND\0"
SIG = b"TKVBSIG\0"
BUNDLE_VERSION = 2  # 2 added the signature trailer; version 1 bundles read as unsigned
FORMAT = "tierkv-bundle"
SIGNED_DOMAIN = b"tierkv-bundle-signature-v2\0"
MAX_HEADER_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
MAX_TOKENS = 1 << 24  # 64 MiB of token ids (1M blocks of 16): far beyond any context
MAX_PAGE_BYTES = 256 << 20  # a 70B-class model's page is ~5 MiB
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
        if nests_deeper_than(raw, MAX_JSON_DEPTH):
            raise BundleError(f"bundle header nests deeper than {MAX_JSON_DEPTH} levels")
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
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise BundleError(f"damaged bundle header ({type(e).__name__}: {e})") from e
        if h.checksum != "xxh3_64":
            raise BundleError(f"unknown page checksum {h.checksum!r}")
        if not 0 <= h.tokens <= MAX_TOKENS or h.blocks * layout.block_size != h.tokens or h.blocks < 1:
            raise BundleError(f"header says {h.tokens} tokens in {h.blocks} blocks of {layout.block_size} "
                              f"(at most {MAX_TOKENS} tokens)")
        if layout.page_bytes > MAX_PAGE_BYTES:
            raise BundleError(f"header declares pages of {layout.page_bytes} bytes (at most {MAX_PAGE_BYTES})")
        return h


def _check_byteorder() -> None:
    if sys.byteorder != "little":  # pages are written in native order, which the format fixes
        raise BundleError("bundles are little-endian; this host is big-endian", hint="export/import on a little-endian host")


def page_digest(data: np.ndarray | bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)
