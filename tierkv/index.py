"""The durable index: LMDB databases for blocks, named manifests, store metadata and quarantine.

Usage rules (py-lmdb's): one environment per process, opened after any fork; short
transactions, always in ``with``; no buffer outlives its transaction (we copy out with
``bytes()``); ``reader_check()`` clears reader slots of killed processes: at open, then
every ``READER_CHECK_S`` seconds (checked at the start of each transaction, so a store that
is used keeps its reader table clean, embedded or under the daemon), and at once when a read
finds the table full (then it retries once).
Errors: no ``lmdb.Error`` leaves this module. A failed write is an ``IndexWriteError``
(``IndexFullError`` at the map size, ``IndexNoSpaceError`` when the file system is full);
nothing of it was committed. A failed read is an ``IndexReadError``.
Durability: ``sync=True, metasync=True`` (never ``sync=False`` with ``writemap``), so a
committed transaction survives a crash. The store commits a block only after its page is
on disk and fsynced, and deletes by committing here first.

Records are a fixed little-endian struct plus the namespace and the token ids (int32), no
pickle: see docs/format.md.
"""
from __future__ import annotations

import errno
import heapq
import json
import logging
import os
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, TypeVar

import lmdb

from .errors import IndexFullError, IndexNoSpaceError, IndexReadError, IndexWriteError
from .index_check import check_index, peek_in_child

log = logging.getLogger(__name__)
T = TypeVar("T")
RECORD_VERSION = 1
NO_DISK = -1
_HEAD = struct.Struct("<B32s32sBQqdHI")
_LAST_ACCESS = struct.Struct("<d")
_LAST_ACCESS_AT = struct.calcsize(_HEAD.format[: _HEAD.format.index("d")])  # where _HEAD's "d" (last_access) starts
READER_CHECK_S = 30.0  # how often a used index clears reader slots of dead processes
MAX_READERS = 256


@dataclass(frozen=True)
class BlockRecord:
    key: bytes
    parent: bytes  # key of the previous block, or the scope's seed for the first block
    model_version: str
    namespace: str
    priority: int
    checksum: int
    disk_loc: int
    last_access: float
    tokens: bytes  # int32 little endian, exactly block_size ids

    def encode(self) -> bytes:
        ns = self.namespace.encode()
        head = _HEAD.pack(
            RECORD_VERSION, self.parent, bytes.fromhex(self.model_version), self.priority,
            self.checksum, self.disk_loc, self.last_access, len(ns), len(self.tokens) // 4,
        )
        return head + ns + self.tokens

    @classmethod
    def decode(cls, key: bytes, raw: bytes) -> "BlockRecord":
        ver, parent, mv, prio, csum, loc, last, ns_len, n_tok = _HEAD.unpack_from(raw)
        if ver != RECORD_VERSION:
            raise ValueError(f"record version {ver}")
        off = _HEAD.size
        ns = raw[off : off + ns_len].decode()
        tokens = bytes(raw[off + ns_len : off + ns_len + 4 * n_tok])
        if len(tokens) != 4 * n_tok:
            raise ValueError("truncated record")
        return cls(bytes(key), bytes(parent), mv.hex(), ns, prio, csum, loc, last, tokens)

    def slot_body(self) -> bytes:
        """This record as its segment slot carries it (the key, then :meth:`encode`), so the
        index can be rebuilt from the segments (tierkv.repair; docs/format.md)."""
        return self.key + self.encode()

    @classmethod
    def from_slot_body(cls, body: bytes) -> "BlockRecord":
        """Inverse of :meth:`slot_body`; raises ValueError or struct.error when damaged."""
        if len(body) < 32 + _HEAD.size:
            raise ValueError("slot record too short")
        return cls.decode(body[:32], body[32:])


def peek_meta(path: Path, name: str) -> str | None:
    """One value of the ``meta`` database of the index at ``path``, read without opening the
    store: read-only and without LMDB's lock table, so it works beside a running owner. None
    when there is no index or no such value. Never call it while this process holds the
    index open (LMDB allows one environment per path per process). The read runs in a child
    process after the meta-page check, so a damaged file raises IndexDamagedError here
    instead of killing this process (see index_check.py)."""
    if not (path / "data.mdb").exists():
        return None
    return peek_in_child(path, name)


def _copy(v: bytes | None) -> bytes | None:
    """Copy a value out of its transaction (a zero-copy buffer dies with it)."""
    return None if v is None else bytes(v)


class Index:
    def __init__(self, path: Path, map_size: int, max_readers: int = MAX_READERS) -> None:
        # Before mapping: a truncated or unreadable file would kill this process (SIGBUS,
        # SIGABRT); the check raises IndexDamagedError instead (index_check.py).
        check_index(path)
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        try:
            self.env = lmdb.open(
                str(path), map_size=map_size, max_dbs=8, subdir=True, sync=True, metasync=True,
                lock=True, max_readers=max_readers,
            )
        except lmdb.Error as e:
            raise IndexReadError(f"cannot open the index at {path}: {e}") from e
        try:
            self.stale_readers_cleared = 0
            self._last_reader_check = 0.0
            self.reader_check()
            self._blocks = self.env.open_db(b"blocks")
            self._manifests = self.env.open_db(b"manifests")
            self._meta = self.env.open_db(b"meta")
            self._quarantine = self.env.open_db(b"quarantine")
        except lmdb.Error as e:
            self.env.close()
            raise IndexWriteError(f"cannot prepare the index at {path}: {e}") from e
        self.resizes = 0

    def reader_check(self) -> int:
        """Clear reader slots left by dead processes (a killed client's read transaction
        pins old pages and takes a slot for good); returns how many were cleared."""
        self._last_reader_check = time.monotonic()
        try:
            n = int(self.env.reader_check())
        except lmdb.Error as e:
            raise IndexReadError(f"reader check of the index at {self.path} failed: {e}") from e
        if n:
            log.warning("index %s: cleared %d reader slot(s) of dead processes", self.path, n)
            self.stale_readers_cleared += n
        return n

    def _maybe_reader_check(self) -> None:
        if time.monotonic() - self._last_reader_check >= READER_CHECK_S:
            self.reader_check()

    def _read(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a read transaction. A full reader table (slots of killed readers)
        is cleared with reader_check() and the read retried once."""
        self._maybe_reader_check()
        for attempt in (0, 1):
            try:
                with self.env.begin() as txn:
                    return fn(txn)
            except lmdb.ReadersFullError as e:
                if attempt or not self.reader_check():
                    raise IndexReadError(
                        f"the index at {self.path} has no free reader slot ({e})",
                        hint="too many concurrent readers of HOME/index; close other openers of this home",
                    ) from e
            except lmdb.Error as e:
                raise IndexReadError(f"reading the index at {self.path} failed: {e}") from e
        raise AssertionError("unreachable")

    def _write_failed(self, e: lmdb.Error) -> IndexWriteError:
        """The typed error for a write LMDB refused. LMDB reports ENOSPC during a commit as
        an I/O error, so a full file system is recognised by its free space."""
        msg = f"the index at {self.path} could not record a change: {e}"
        try:
            st = os.statvfs(self.path)
            full = st.f_bavail * st.f_frsize < (1 << 20)
        except OSError:
            full = False
        if full or isinstance(e, lmdb.DiskError) and os.strerror(errno.ENOSPC) in str(e):
            return IndexNoSpaceError(msg)
        return IndexWriteError(msg)

    def _write(self, fn: Callable[[lmdb.Transaction], T]) -> T:
        """Run ``fn`` in a write transaction. The first MapFullError of this environment's
        life doubles the map and retries; after that the index is full (IndexFullError):
        ``index_map_bytes`` is the configured size limit, and growing without bound would
        turn a runaway writer into a full disk."""
        self._maybe_reader_check()
        for attempt in (0, 1):
            try:
                with self.env.begin(write=True) as txn:
                    return fn(txn)
            except lmdb.MapFullError:
                if attempt or self.resizes:
                    break
                new = self.env.info()["map_size"] * 2
                log.warning("index map full, growing to %d bytes", new)
                try:
                    self.env.set_mapsize(new)
                except lmdb.Error as e:
                    raise self._write_failed(e) from e
                self.resizes += 1
            except lmdb.Error as e:
                log.error("index write failed: %s", e)
                raise self._write_failed(e) from e
        raise IndexFullError(f"the index at {self.path} is full at {self.env.info()['map_size']} bytes")

    # ---- meta ------------------------------------------------------------------------
    def get_meta(self, name: str) -> str | None:
        v = self._read(lambda txn: _copy(txn.get(name.encode(), db=self._meta)))
        return None if v is None else v.decode()

    def put_meta(self, name: str, value: str) -> None:
        self._write(lambda txn: txn.put(name.encode(), value.encode(), db=self._meta))

    def delete_meta(self, name: str) -> bool:
        """Delete a meta entry; False when there was none."""
        return bool(self._write(lambda txn: txn.delete(name.encode(), db=self._meta)))

    # ---- blocks ----------------------------------------------------------------------
    def put_blocks(self, records: Iterable[BlockRecord]) -> None:
        recs = list(records)

        def put(txn: lmdb.Transaction) -> None:
            for r in recs:
                txn.put(r.key, r.encode(), db=self._blocks)

        self._write(put)

    def delete_blocks(self, keys: Iterable[bytes]) -> None:
        ks = list(keys)

        def delete(txn: lmdb.Transaction) -> None:
            for k in ks:
                txn.delete(k, db=self._blocks)

        self._write(delete)

    def get_block(self, key: bytes) -> BlockRecord | None:
        raw = self._read(lambda txn: _copy(txn.get(key, db=self._blocks)))
        return None if raw is None else BlockRecord.decode(key, raw)

    def iter_blocks(self) -> Iterator[tuple[bytes, BlockRecord | None]]:
        """Every stored block; ``None`` for a record that does not decode (the caller drops it)."""
        items = self._read(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._blocks)])
        for k, v in items:
            try:
                yield k, BlockRecord.decode(k, v)
            except (ValueError, struct.error):
                yield k, None

    def newest(self, n: int) -> list[bytes]:
        """The keys of the ``n`` blocks written last (``last_access``), oldest of them
        first; records too short to hold a head are skipped. One pass, reading only each
        record's head and keeping ``n`` keys (a warm start after a crash, where the home
        may hold millions of blocks)."""
        if n <= 0:
            return []
        size, at, unpack = _HEAD.size, _LAST_ACCESS_AT, _LAST_ACCESS.unpack_from

        def scan(txn: lmdb.Transaction) -> list[tuple[float, bytes]]:
            heap: list[tuple[float, bytes]] = []
            for k, v in txn.cursor(db=self._blocks):
                if len(v) < size:
                    continue
                item = (unpack(v, at)[0], bytes(k))
                if len(heap) < n:
                    heapq.heappush(heap, item)
                elif item > heap[0]:
                    heapq.heapreplace(heap, item)
            return heap

        return [k for _, k in sorted(self._read(scan))]

    def count_blocks(self) -> int:
        return self._read(lambda txn: int(txn.stat(self._blocks)["entries"]))

    # ---- quarantine ------------------------------------------------------------------
    def quarantine(self, key: bytes, reason: str, delete: bool = True) -> None:
        """Record why a block was dropped and (in the same transaction) drop it."""

        def q(txn: lmdb.Transaction) -> None:
            txn.put(key, json.dumps({"reason": reason}).encode(), db=self._quarantine)
            if delete:
                txn.delete(key, db=self._blocks)

        self._write(q)

    def quarantined(self) -> dict[str, str]:
        items = self._read(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._quarantine)])
        return {k.hex(): json.loads(v)["reason"] for k, v in items}

    # ---- manifests -------------------------------------------------------------------
    def put_manifest(self, name: str, manifest: dict) -> None:
        raw = json.dumps(manifest, sort_keys=True).encode()
        self._write(lambda txn: txn.put(name.encode(), raw, db=self._manifests))

    def get_manifest(self, name: str) -> dict | None:
        v = self._read(lambda txn: _copy(txn.get(name.encode(), db=self._manifests)))
        return None if v is None else json.loads(v)

    def list_manifests(self) -> dict[str, dict]:
        items = self._read(lambda txn: [(bytes(k), bytes(v)) for k, v in txn.cursor(db=self._manifests)])
        return {k.decode(): json.loads(v) for k, v in items}

    def delete_manifest(self, name: str) -> bool:
        return bool(self._write(lambda txn: txn.delete(name.encode(), db=self._manifests)))

    def check_integrity(self) -> None:
        for k, rec in self.iter_blocks():
            assert rec is not None, f"undecodable record {k.hex()}"
            assert rec.key == k

    def close(self) -> None:
        self.env.close()
