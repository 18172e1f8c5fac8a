"""Block identity: a chained SHA-256 over a typed, length-prefixed encoding.

    seed      = H(enc("tierkv/seed/v1"), field("model_version"), field("namespace"), field("extra", ...))
    key[0]    = H(enc("tierkv/block/v1"), seed,     tokens[0:B],  field("block_extra", ...))
    key[i]    = H(enc("tierkv/block/v1"), key[i-1], tokens[iB:(i+1)B], ...)

Every value is written as ``type tag (1 byte) | length (8 bytes, little endian) | bytes``
and every field carries its name, so ("ab", "c") never encodes like ("a", "bc") and a
namespace "X" never collides with an adapter "X". Token ids are little-endian int32.
Nothing here depends on Python's ``hash()`` or the process: keys are identical across
processes, Python versions and ``PYTHONHASHSEED`` (pinned by test vectors).

Only full blocks get keys; a trailing partial block is never stored.
"""
from __future__ import annotations

import array
import hashlib
import struct
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cached_property
from typing import Iterator, Sequence

import numpy as np

from .errors import InvalidTokensError

KEY_BYTES = 32
_I4 = np.dtype("<i4")
# array("i") is a little-endian int32 on every platform tierkv runs on; checked, not assumed.
_ARRAY_I4 = array.array("i").itemsize == 4 and sys.byteorder == "little"
_U64 = struct.Struct("<Q")
SEED_DOMAIN = "tierkv/seed/v1"
BLOCK_DOMAIN = "tierkv/block/v1"


def _item(tag: bytes, payload: bytes) -> bytes:
    return tag + _U64.pack(len(payload)) + payload


def enc_str(s: str) -> bytes:
    return _item(b"s", s.encode("utf-8"))


def enc_bytes(b: bytes) -> bytes:
    return _item(b"b", bytes(b))


def enc_field(name: str, value: str | bytes | Sequence[str | bytes]) -> bytes:
    """A named field; a sequence becomes a counted list of typed items."""
    if isinstance(value, str):
        body = enc_str(value)
    elif isinstance(value, (bytes, bytearray)):
        body = enc_bytes(bytes(value))
    else:
        items = list(value)
        body = _item(b"l", b"".join(enc_str(v) if isinstance(v, str) else enc_bytes(bytes(v)) for v in items))
    return _item(b"f", enc_str(name) + body)


def as_token_array(tokens: Sequence[int] | np.ndarray | "object") -> np.ndarray:
    """Validate token ids and return them as a contiguous little-endian int32 array."""
    # A tensor implies torch is already imported; looking it up in sys.modules keeps key
    # computation free of a multi-second torch import in processes that never use it.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if type(tokens) is list and tokens and type(tokens[0]) is int and _ARRAY_I4:
        # A list of Python ints (vLLM's prompt_token_ids): array("i") converts it in one C
        # loop and refuses floats, strings and ints beyond int32 (np.asarray went through
        # int64 and two reductions: 0.13 ms against 0.09 ms for 4,096 tokens).
        try:
            arr = np.frombuffer(array.array("i", tokens), dtype=_I4)
        except (TypeError, OverflowError):
            pass  # the general path below says what is wrong
        else:
            if int(arr.min()) < 0:
                raise InvalidTokensError(f"token ids must lie in [0, 2**31), got min {int(arr.min())}")
            return arr
    try:
        arr = np.asarray(tokens)
    except ValueError:  # a ragged nesting such as [1, [2], 3]
        raise InvalidTokensError("token ids must be a flat sequence of integers") from None
    if arr.dtype == _I4 and arr.ndim == 1 and arr.size and arr.flags.c_contiguous:
        # The common case (the store's own arrays, passed back in): one reduction; an
        # int32 is below 2**31 by its type.
        if int(arr.min()) < 0:
            raise InvalidTokensError(f"token ids must lie in [0, 2**31), got min {int(arr.min())}")
        return arr
    if arr.ndim != 1:
        raise InvalidTokensError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype="<i4")
    if arr.dtype.kind not in "iu":
        raise InvalidTokensError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= 2**31:
        raise InvalidTokensError(f"token ids must lie in [0, 2**31), got min {lo} max {hi}")
    return np.ascontiguousarray(arr, dtype="<i4")


@dataclass(frozen=True)
class Scope:
    """Everything request-wide that a block key is rooted in.

    ``model_version`` is the hex digest from :mod:`tierkv.model_version`; ``namespace`` is
    the tenant salt (derived on the trusted side); ``extra_keys`` are request-wide extras
    such as a LoRA adapter id.
    """

    model_version: str
    namespace: str = "default"
    extra_keys: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        try:
            raw = bytes.fromhex(self.model_version)
        except ValueError:
            raw = b""
        if len(raw) != KEY_BYTES:
            raise ValueError(f"model_version must be 64 hex characters, got {self.model_version!r}")
        if not isinstance(self.namespace, str) or not self.namespace:
            raise ValueError("namespace must be a non-empty string")
        extra = (self.extra_keys,) if isinstance(self.extra_keys, str) else self.extra_keys
        # A bare string is one key, not a sequence of one-character keys ("ab" != ("a", "b")).
        object.__setattr__(self, "extra_keys", tuple(str(x) for x in extra))

    @property
    def model_version_bytes(self) -> bytes:
        return bytes.fromhex(self.model_version)

    @cached_property
    def seed(self) -> bytes:
        return hashlib.sha256(
            enc_str(SEED_DOMAIN)
            + enc_field("model_version", self.model_version_bytes)
            + enc_field("namespace", self.namespace)
            + enc_field("extra_keys", self.extra_keys)
        ).digest()


# Precomputed pieces of the block encoding: domain | parent | tokens item | extras item.
_BLOCK_PREFIX = enc_str(BLOCK_DOMAIN) + b"b" + _U64.pack(KEY_BYTES)
_NO_EXTRA = enc_field("block_extra", ())


def iter_block_keys(
    tokens: np.ndarray,
    seed: bytes,
    block_size: int,
    block_extra: Sequence[Sequence[str | bytes]] | None = None,
    start: int = 0,
    parent: bytes | None = None,
    raw: bytes | memoryview | None = None,
) -> Iterator[bytes]:
    """Yield the key of each full block of ``tokens`` (an int32 array from
    :func:`as_token_array`), lazily so that a lookup stops hashing at its first miss.

    ``start``/``parent``: resume the chain at block ``start``, whose parent key (the key
    of block ``start - 1``, computed here earlier from the same tokens) is ``parent``.
    ``raw``: the bytes of ``tokens`` (or a byte view of them) when the caller has them."""
    n_blocks = len(tokens) // block_size
    # ``raw``: the caller's bytes of ``tokens`` (tobytes() of a 16k-token prompt again, to
    # hash a block or two of it, was a measurable share of a lookup). The store passes a
    # view of the request's array: should a caller change its array during the call, a key
    # may come from other bytes than those compared or stored with it, and a hit still
    # needs the stored ids to equal the request's, so such a block is a miss, never served.
    raw = memoryview(tokens.tobytes() if raw is None else raw)
    step = block_size * 4
    tok_head = b"t" + _U64.pack(step)
    prev = seed
    if start:
        if parent is None:
            raise ValueError("resuming a key chain needs the parent key")
        prev = parent
    sha, join = hashlib.sha256, b"".join
    if block_extra is None:
        for i in range(start, n_blocks):  # slices of the view: one copy per block, in join
            prev = sha(join((_BLOCK_PREFIX, prev, tok_head, raw[i * step : (i + 1) * step], _NO_EXTRA))).digest()
            yield prev
        return
    for i in range(start, n_blocks):
        extra = _NO_EXTRA if i >= len(block_extra) else enc_field("block_extra", block_extra[i])
        prev = sha(_BLOCK_PREFIX + prev + tok_head + raw[i * step : (i + 1) * step] + extra).digest()
        yield prev


def block_keys(
    tokens: Sequence[int] | np.ndarray,
    scope: Scope,
    block_size: int,
    block_extra: Sequence[Sequence[str | bytes]] | None = None,
) -> list[bytes]:
    """Keys of all full blocks of ``tokens`` under ``scope``."""
    arr = as_token_array(tokens)
    return list(iter_block_keys(arr, scope.seed, block_size, block_extra))


def same_bytes(a: bytes, b: bytes | memoryview) -> bool:
    """``a == b`` where ``b`` may be a byte view: ``startswith`` over equal lengths is one
    memcmp, where ``==`` between bytes and a memoryview compares item by item (~40x slower)."""
    return len(a) == len(b) and a.startswith(b)


class ChainMemo:
    """Key chains this store hashed recently, so that a prompt repeating a known prefix
    (the put after a lookup's miss, the next turn of a conversation, the next request on a
    shared document) is not hashed again (issue #15: no second hashing of the same prompt).

    Nothing a client sends is trusted: a remembered key is reused only for a prefix whose
    token bytes equal, byte for byte, the bytes it was computed from here, under the same
    seed and without block extras; keys are a pure function of those, so a reused key is
    exactly the key hashing would give. Chains are found by their seed and first block's
    bytes; of those (a few, most recent first) the one sharing the longest prefix with the
    request proves it (a memcmp, and numpy to find the first differing block). Bounded by
    ``max_bytes`` of remembered token bytes, least recently used first out; thread-safe (a
    put asks outside the store lock)."""

    PER_START = 4  # chains kept per (seed, first block): prompts on one shared beginning

    def __init__(self, max_bytes: int = 64 << 20) -> None:
        self.max_bytes = max_bytes
        self._bytes = 0
        self._chains: OrderedDict[tuple[bytes, bytes], list[tuple[bytes, tuple[bytes, ...]]]] = OrderedDict()
        self._lock = threading.Lock()

    def remember(self, seed: bytes, raw: bytes | memoryview, step: int, keys: Sequence[bytes]) -> None:
        """``keys[i]`` was computed from ``seed`` and ``raw[: (i + 1) * step]`` (``step``:
        bytes per block; ``raw``: bytes, or a byte view of the caller's tokens, copied here)."""
        n = len(keys)
        if not n or len(raw) < n * step:
            return
        known = raw if type(raw) is bytes and len(raw) == n * step else bytes(raw[: n * step])
        slot = (seed, known[:step])
        with self._lock:
            chains = self._chains.get(slot)
            if chains is None:
                chains = self._chains[slot] = []
            else:
                self._chains.move_to_end(slot)
                for j, (old, _) in enumerate(chains):
                    if len(old) >= len(known) and old.startswith(known):
                        if j:  # already known: most recent first
                            chains.insert(0, chains.pop(j))
                        return
                    if known.startswith(old):  # this chain extends a remembered one
                        self._bytes -= len(chains.pop(j)[0])
                        break
            chains.insert(0, (known, tuple(keys)))
            self._bytes += len(known)
            if len(chains) > self.PER_START:
                self._bytes -= len(chains.pop()[0])
            while self._bytes > self.max_bytes and self._chains:
                _, dropped = self._chains.popitem(last=False)
                self._bytes -= sum(len(r) for r, _ in dropped)

    def chain_keys(self, arr: np.ndarray, seed: bytes, block_size: int, n: int,
                   block_extra: Sequence[Sequence[str | bytes]] | None = None) -> list[bytes]:
        """The keys of blocks ``0 .. n-1`` of ``arr`` (from :func:`as_token_array`) under
        ``seed``: those a remembered chain proves (:meth:`proven`), the rest hashed and then
        remembered, so that the next call on this prefix hashes none of it. With block
        extras nothing is proved or remembered: all are hashed."""
        step = 4 * block_size
        raw = arr.data.cast("B")  # a view of the caller's array, not a copy
        known = self.proven(seed, raw, step, n) if block_extra is None else ()
        keys = list(known)
        keys.extend(iter_block_keys(arr[: n * block_size], seed, block_size, block_extra, start=len(keys),
                                    parent=keys[-1] if keys else None, raw=memoryview(raw)[: n * step]))
        if block_extra is None and len(keys) > len(known):
            self.remember(seed, raw, step, keys)
        return keys

    def proven(self, seed: bytes, raw: bytes | memoryview, step: int, n: int) -> tuple[bytes, ...]:
        """The first ``k <= n`` keys of ``raw`` under ``seed`` (``step``: bytes per block;
        ``raw``: bytes or a byte view) that a remembered chain proves; empty when none
        proves any."""
        if n <= 0 or len(raw) < step:
            return ()
        with self._lock:
            chains = self._chains.get((seed, bytes(raw[:step])))
            if not chains:
                return ()
            best: tuple[bytes, ...] = ()
            for known, keys in chains:
                m = min(n, len(keys), len(raw) // step, len(known) // step)
                if m <= len(best):
                    continue
                view = memoryview(raw)
                if known.startswith(view[: m * step]):
                    k = m
                else:
                    # The blocks before the first that differs, by bisection with memcmp over
                    # the bytes not compared yet: block 0 is equal (the slot says so), block
                    # m - 1 is not. (numpy's argmax over an elementwise compare of the whole
                    # prefix cost 8 us a call, most of a lookup's proof.)
                    lo, hi = 1, m
                    while hi - lo > 1:
                        mid = (lo + hi) // 2
                        if known.startswith(view[lo * step : mid * step], lo * step):
                            lo = mid
                        else:
                            hi = mid
                    k = lo
                if k > len(best):
                    best = keys[:k]
            return best
