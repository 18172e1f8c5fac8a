"""The checks every message field goes through when decoded (type, length, bound; a
failure is a ProtocolError), and the wire forms shared by several messages: token ids as
the payload (int32 LE), block keys in a reply's payload and ``block_extra``. The message
dataclasses themselves are in messages.py.
"""
from __future__ import annotations

import functools
import struct
from typing import Any, Sequence

import numpy as np

from ..errors import ProtocolError
from ..identity import KEY_BYTES
from .protocol import MAX_TOKENS

MAX_STR = 4096
MAX_LIST = 1 << 16
MAX_PAGE_BYTES = 1 << 30  # one page (one block of every layer's K and V)
# The smallest page a client may declare. The daemon keeps Python objects per slot of each
# memory tier and of staging (a slot allocator's free heap and used set: 40 bytes a slot
# free, 66 used, measured), and a tier has budget // page_bytes slots: a 2-byte page made
# 1.75 GiB of them per 64 MiB of device budget and stalled every client (issue 34, item 2).
# At 512 bytes they stay near a tenth of the budget they index. 512 is also the smallest
# real page: 1 layer, 1 KV head, head_dim 8, 16 tokens, float16.
MIN_PAGE_BYTES = 512
Header = dict[str, Any]


def _get(h: Header, name: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
    if name not in h:
        if default is ...:
            raise ProtocolError(f"message field {name!r} is missing")
        return default
    v = h[name]
    if v is None and default is None:
        return None
    if kind is int and isinstance(v, bool) or not isinstance(v, kind):
        raise ProtocolError(f"message field {name!r} has type {type(v).__name__}")
    if isinstance(v, str) and len(v) > MAX_STR:
        raise ProtocolError(f"message field {name!r} is longer than {MAX_STR} characters")
    if isinstance(v, list) and len(v) > MAX_LIST:
        raise ProtocolError(f"message field {name!r} has more than {MAX_LIST} items")
    return v


def _int(h: Header, name: str, lo: int = 0, hi: int = 2**63 - 1, default: Any = ...) -> int:
    v = _get(h, name, int, default)
    if v is not None and not lo <= v <= hi:
        raise ProtocolError(f"message field {name!r}={v} is outside [{lo}, {hi}]")
    return v


def _ints(h: Header, name: str) -> tuple[int, ...]:
    v = _get(h, name, list)
    if not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**31 for x in v):
        raise ProtocolError(f"message field {name!r} must be a list of non-negative ints")
    return tuple(v)


def _strs(h: Header, name: str) -> tuple[str, ...]:
    """A list of at most MAX_LIST strings of at most MAX_STR characters (default empty)."""
    v = _get(h, name, list, [])
    if len(v) > MAX_LIST or not all(isinstance(x, str) and len(x) <= MAX_STR for x in v):
        raise ProtocolError(f"{name} must be a list of at most {MAX_LIST} strings of at most {MAX_STR} characters")
    return tuple(v)


SPLIT_STRUCT_MAX = 4096  # keys split by one cached struct up to this many (a reply of a long prompt)


@functools.lru_cache(maxsize=32)
def _keys_struct(n: int) -> struct.Struct:
    return struct.Struct(f"{KEY_BYTES}s" * n)


def split_keys(payload: bytes, n: int) -> tuple[bytes, ...]:
    """The first ``n`` keys of ``payload`` (``KEY_BYTES`` each), as bytes: one struct unpack
    for a reply of up to SPLIT_STRUCT_MAX keys (a fifth of the cost of slicing them in
    Python, paid on every acquire a client makes)."""
    if n <= SPLIT_STRUCT_MAX:
        return _keys_struct(n).unpack_from(payload)
    return tuple([payload[i : i + KEY_BYTES] for i in range(0, n * KEY_BYTES, KEY_BYTES)])


def tokens_payload(tokens: np.ndarray) -> bytes:
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def tokens_from(payload: bytes) -> np.ndarray:
    if len(payload) % 4:
        raise ProtocolError(f"token payload of {len(payload)} bytes is not a multiple of 4")
    if len(payload) // 4 > MAX_TOKENS:
        raise ProtocolError(f"more than {MAX_TOKENS} token ids in one request")
    return np.frombuffer(payload, dtype="<i4")


def extra_to_wire(extra: Sequence[Sequence[str | bytes]] | None) -> list | None:
    if extra is None:
        return None
    return [[x if isinstance(x, str) else {"b": bytes(x).hex()} for x in items] for items in extra]


def extra_from_wire(h: Header) -> list[list[str | bytes]] | None:
    raw = _get(h, "block_extra", (list, type(None)), None)
    if raw is None:
        return None
    out: list[list[str | bytes]] = []
    for items in raw:
        if not isinstance(items, list) or len(items) > 64:
            raise ProtocolError("block_extra must be a list of lists (at most 64 items each)")
        row: list[str | bytes] = []
        for x in items:
            if isinstance(x, str) and len(x) <= MAX_STR:
                row.append(x)
            elif isinstance(x, dict) and isinstance(x.get("b"), str) and len(x["b"]) <= 2 * MAX_STR:
                try:
                    row.append(bytes.fromhex(x["b"]))
                except ValueError:
                    raise ProtocolError("block_extra bytes item is not hex") from None
            else:
                raise ProtocolError("block_extra items must be strings or {'b': hex}")
        out.append(row)
    return out
