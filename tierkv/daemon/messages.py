"""One small dataclass per message, each with explicit ``encode() -> (header, payload)`` and
``decode(header, payload)``. Decoding checks every field's type and bound and raises
ProtocolError; nothing here trusts the peer. Token ids are the payload (int32 LE). The field
checks and shared wire forms are in fields.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import ProtocolError
from ..identity import KEY_BYTES, Scope
from ..layout import PageLayout
from .fields import (MAX_LIST, MAX_PAGE_BYTES, MIN_PAGE_BYTES, MAX_STR, Header, _get, _int, _ints,
                     _strs, extra_from_wire, extra_to_wire, split_keys, tokens_from, tokens_payload)
from .protocol import MAX_TOKENS

# What a daemon handler answers: the reply's header and payload (HELLO adds the descriptors
# sent with it). Not ``Reply`` below, the decoded reply a client reads.
Answer = tuple[Header, bytes]


@dataclass(frozen=True)
class WireScope:
    """The scope as the client states it; the daemon derives the effective namespace."""

    model_version: str
    namespace: str = "default"
    extra_keys: tuple[str, ...] = ()

    @classmethod
    def of(cls, scope: Scope) -> "WireScope":
        """The wire form of ``scope``: the one place a client builds it."""
        return cls(scope.model_version, scope.namespace, tuple(scope.extra_keys))

    def to_wire(self) -> Header:
        return {"model_version": self.model_version, "namespace": self.namespace, "extra_keys": list(self.extra_keys)}

    @classmethod
    def from_wire(cls, h: Header) -> "WireScope":
        s = _get(h, "scope", dict)
        extra = _get(s, "extra_keys", list, [])
        if not all(isinstance(x, str) and len(x) <= MAX_STR for x in extra):
            raise ProtocolError("scope.extra_keys must be strings")
        return cls(_get(s, "model_version", str), _get(s, "namespace", str), tuple(extra))


# ---- requests -------------------------------------------------------------------------
@dataclass(frozen=True)
class Hello:
    """The first request. ``layout`` declares the page layout this client stores and reads
    (the daemon opens a store for it on first use); None: no data path (operations tools),
    or the daemon's only layout when it serves exactly one."""

    client_version: int
    pid: int
    layout: PageLayout | None = None

    def encode(self) -> tuple[Header, bytes]:
        h: Header = {"client_version": self.client_version, "pid": self.pid}
        if self.layout is not None:
            h["layout"] = self.layout.to_dict()
        return h, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Hello":
        raw = _get(h, "layout", (dict, type(None)), None)
        return cls(_int(h, "client_version"), _int(h, "pid"), None if raw is None else layout_from_wire(raw))


def layout_from_wire(raw: Header) -> PageLayout:
    """A declared layout, every field checked (PageLayout validates values; the bounds here
    keep a hostile client from asking for absurd pages)."""
    try:
        layout = PageLayout(num_layers=_int(raw, "num_layers", 1, 4096), num_kv_heads=_int(raw, "num_kv_heads", 1, 4096),
                            head_dim=_int(raw, "head_dim", 1, 65536), block_size=_int(raw, "block_size", 1, 65536),
                            dtype=_get(raw, "dtype", str))
    except ValueError as e:
        raise ProtocolError(f"bad layout: {e}") from None
    if not MIN_PAGE_BYTES <= layout.page_bytes <= MAX_PAGE_BYTES:
        raise ProtocolError(f"a page of layout {layout.to_json()} is {layout.page_bytes} bytes; the daemon accepts "
                            f"pages of {MIN_PAGE_BYTES} to {MAX_PAGE_BYTES} bytes (one block of every layer's K and V)")
    return layout


@dataclass(frozen=True)
class PrefixRequest:
    """LOOKUP, ACQUIRE and PREFETCH: tokens, scope, per-block extras (and max_blocks)."""

    scope: WireScope
    tokens: np.ndarray
    block_extra: Sequence[Sequence[str | bytes]] | None = None
    max_blocks: int | None = None
    start_block: int = 0

    def encode(self) -> tuple[Header, bytes]:
        h = {"scope": self.scope.to_wire(), "block_extra": extra_to_wire(self.block_extra), "max_blocks": self.max_blocks,
             "start_block": self.start_block}
        return h, tokens_payload(self.tokens)

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "PrefixRequest":
        return cls(WireScope.from_wire(h), tokens_from(payload), extra_from_wire(h),
                   _int(h, "max_blocks", 0, MAX_TOKENS, None), _int(h, "start_block", 0, MAX_TOKENS, 0))


@dataclass(frozen=True)
class Release:
    """RELEASE of one or more leases. With ``reply=False`` the daemon sends no reply (and
    logs a failure instead): a release is off the client's critical path, one write, no
    round trip. The daemon ends the store leases before any later request of the same
    connection runs its store call, so the client still reads its own writes."""

    lease_ids: tuple[int, ...]
    reply: bool = True

    def encode(self) -> tuple[Header, bytes]:
        return {"lease_ids": list(self.lease_ids), "reply": self.reply}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Release":
        if "lease_id" in h:  # a client of the first version: one lease, a reply
            return cls((_int(h, "lease_id"),))
        ids = _get(h, "lease_ids", list)
        if not ids or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x < 2**63 for x in ids):
            raise ProtocolError("lease_ids must be a non-empty list of lease ids")
        return cls(tuple(ids), _get(h, "reply", bool, True))


@dataclass(frozen=True)
class LeaseRef:
    """RENEW (and, from clients of the first version, RELEASE)."""

    lease_id: int

    def encode(self) -> tuple[Header, bytes]:
        return {"lease_id": self.lease_id}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "LeaseRef":
        return cls(_int(h, "lease_id"))


@dataclass(frozen=True)
class Stage:
    count: int

    def encode(self) -> tuple[Header, bytes]:
        return {"count": self.count}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Stage":
        return cls(_int(h, "count", 1, MAX_LIST))


@dataclass(frozen=True)
class Unstage:
    slots: tuple[int, ...]

    def encode(self) -> tuple[Header, bytes]:
        return {"slots": list(self.slots)}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Unstage":
        return cls(_ints(h, "slots"))


@dataclass(frozen=True)
class Commit:
    """Store the pages the client wrote into staging ``slots`` as blocks ``start_block..``."""

    scope: WireScope
    tokens: np.ndarray
    slots: tuple[int, ...]
    start_block: int = 0
    block_extra: Sequence[Sequence[str | bytes]] | None = None
    priority: int = 1

    def encode(self) -> tuple[Header, bytes]:
        h = {"scope": self.scope.to_wire(), "slots": list(self.slots), "start_block": self.start_block,
             "block_extra": extra_to_wire(self.block_extra), "priority": self.priority}
        return h, tokens_payload(self.tokens)

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Commit":
        return cls(WireScope.from_wire(h), tokens_from(payload), _ints(h, "slots"),
                   _int(h, "start_block", 0, MAX_TOKENS), extra_from_wire(h), _int(h, "priority", 0, 2))


@dataclass(frozen=True)
class SetPriority:
    scope: WireScope
    tokens: np.ndarray
    priority: int

    def encode(self) -> tuple[Header, bytes]:
        return {"scope": self.scope.to_wire(), "priority": self.priority}, tokens_payload(self.tokens)

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "SetPriority":
        return cls(WireScope.from_wire(h), tokens_from(payload), _int(h, "priority", 0, 2))


@dataclass(frozen=True)
class ChainRef:
    """CHAIN_TOKENS, CHAIN_RESIDENCY and SET_PRIORITY_FROM: the stored chain ending at
    ``last_key`` (a named prefix's last block key, from its manifest)."""

    last_key: bytes
    priority: int | None = None  # SET_PRIORITY_FROM only

    def encode(self) -> tuple[Header, bytes]:
        return {"last_key": self.last_key.hex(), "priority": self.priority}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "ChainRef":
        raw = _get(h, "last_key", str)
        try:
            key = bytes.fromhex(raw)
        except ValueError:
            raise ProtocolError("last_key is not hex") from None
        if len(key) != KEY_BYTES:
            raise ProtocolError(f"last_key must be {KEY_BYTES} bytes, got {len(key)}")
        return cls(key, _int(h, "priority", 0, 2, None))


@dataclass(frozen=True)
class ManifestRequest:
    """SAVE_MANIFEST (with ``manifest``), GET_MANIFEST and DELETE_MANIFEST."""

    name: str
    manifest: dict | None = None

    def encode(self) -> tuple[Header, bytes]:
        return {"name": self.name, "manifest": self.manifest}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "ManifestRequest":
        # The name's rules (length, '/', valid UTF-8) are the handlers' (tierkv.manifest_names.check_name):
        # a bad name is InvalidNameError, a ValueError like the embedded store's.
        return cls(_get(h, "name", str), _get(h, "manifest", (dict, type(None)), None))


@dataclass(frozen=True)
class Invalidate:
    model_version: str | None = None
    namespace: str | None = None
    dry_run: bool = False

    def encode(self) -> tuple[Header, bytes]:
        return {"model_version": self.model_version, "namespace": self.namespace, "dry_run": self.dry_run}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Invalidate":
        return cls(_get(h, "model_version", (str, type(None)), None), _get(h, "namespace", (str, type(None)), None),
                   _get(h, "dry_run", bool, False))


@dataclass(frozen=True)
class Gc:
    """GC: tierkv.gc's rule, run by the daemon over every store it serves."""

    keep_model_versions: tuple[str, ...] = ()
    keep_namespaces: tuple[str, ...] = ()
    dry_run: bool = False

    def encode(self) -> tuple[Header, bytes]:
        return {"keep_model_versions": list(self.keep_model_versions), "keep_namespaces": list(self.keep_namespaces),
                "dry_run": self.dry_run}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Gc":
        return cls(_strs(h, "keep_model_versions"), _strs(h, "keep_namespaces"), _get(h, "dry_run", bool, False))


@dataclass(frozen=True)
class Verify:
    repair: bool = False

    def encode(self) -> tuple[Header, bytes]:
        return {"repair": self.repair}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Verify":
        return cls(_get(h, "repair", bool, False))


@dataclass(frozen=True)
class Stats:
    """STATS: a page of the namespaces (see StoreAPI.stats); no limit means the daemon's
    default page size."""

    namespace_limit: int | None = None
    namespace_after: str | None = None

    def encode(self) -> tuple[Header, bytes]:
        return {"namespace_limit": self.namespace_limit, "namespace_after": self.namespace_after}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Stats":
        return cls(_int(h, "namespace_limit", 1, 2**31 - 1, None), _get(h, "namespace_after", (str, type(None)), None))


@dataclass(frozen=True)
class LayoutRef:
    """REMOVE_LAYOUT: a layout by its id (``bfloat16-l8-h4-d64-b128``)."""

    layout_id: str

    def encode(self) -> tuple[Header, bytes]:
        return {"layout_id": self.layout_id}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "LayoutRef":
        return cls(_get(h, "layout_id", str))


@dataclass(frozen=True)
class Empty:
    """PING, LIST_MANIFESTS requests, and replies that carry nothing."""

    def encode(self) -> tuple[Header, bytes]:
        return {}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Empty":
        return cls()


# ---- replies ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Reply:
    """A reply whose fields are plain JSON values (results, stats, region descriptions).
    The client checks the fields it uses; the daemon is the trusted side."""

    fields: Header = field(default_factory=dict)

    def encode(self) -> tuple[Header, bytes]:
        return self.fields, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "Reply":
        return cls(h)


@dataclass(frozen=True)
class KeysReply:
    """LOOKUP and ACQUIRE replies: block keys as raw 32-byte strings in the payload (hex in
    JSON would triple their size), then ``values``, one int32 per key (ACQUIRE: the device
    slot; LOOKUP: the tier, an index into the header's ``tier_names``), other fields in the
    header. Per-block lists in the JSON header made a reply of 8,000 blocks exceed the
    64 KiB header limit (issue 11, item 9); the payload holds ~500,000."""

    keys: tuple[bytes, ...]
    fields: Header = field(default_factory=dict)
    values: tuple[int, ...] = ()

    def encode(self) -> tuple[Header, bytes]:
        if self.values and len(self.values) != len(self.keys):
            raise ProtocolError(f"{len(self.values)} values for {len(self.keys)} keys")
        vals = np.asarray(self.values, dtype="<i4").tobytes() if self.values else b""
        return {**self.fields, "num_keys": len(self.keys), "num_values": len(self.values)}, b"".join(self.keys) + vals

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "KeysReply":
        n = _int(h, "num_keys", 0, MAX_TOKENS)
        nv = _int(h, "num_values", 0, MAX_TOKENS, 0)
        if nv not in (0, n) or len(payload) != n * KEY_BYTES + 4 * nv:
            raise ProtocolError(f"{n} keys and {nv} values need {n * KEY_BYTES + 4 * nv} payload bytes, "
                                f"got {len(payload)}")
        keys = split_keys(payload, n)
        values = tuple(np.frombuffer(payload, dtype="<i4", offset=n * KEY_BYTES, count=nv).tolist()) if nv else ()
        return cls(keys, {k: v for k, v in h.items() if k not in ("num_keys", "num_values")}, values)


@dataclass(frozen=True)
class ErrorReply:
    error: str  # the exception class name (a tierkv.errors class, ValueError, ...)
    message: str
    hint: str = ""

    def encode(self) -> tuple[Header, bytes]:
        return {"error": self.error, "message": self.message[:MAX_STR], "hint": self.hint[:MAX_STR]}, b""

    @classmethod
    def decode(cls, h: Header, payload: bytes) -> "ErrorReply":
        return cls(_get(h, "error", str, "TierKVError"), _get(h, "message", str, ""), _get(h, "hint", str, ""))
