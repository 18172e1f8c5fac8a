"""Leases and staging slots held by daemon connections.

A store lease taken for a client belongs to that client's connection: when the connection
ends (the client closed it, exited or was killed, the kernel closes the socket either way)
every lease it still holds is released, so a dead client never pins blocks. A lease not
renewed for ``timeout_s`` is released too (a hung client).

Both tables are touched only from the event loop thread; the store calls that end a lease
run in worker threads, so the methods here *take the leases out* and the caller releases
them in the store.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from ..results import Lease
from ..tiers.base import SlotAllocator


@dataclass
class HeldLease:
    lease_id: int
    conn_id: int
    lease: Lease
    renewed: float = field(default_factory=time.monotonic)


class LeaseTable:
    """Lease id -> store lease, grouped by connection. Only :meth:`add` and :meth:`take*`
    move a lease in or out."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._held: dict[int, HeldLease] = {}
        self._by_conn: dict[int, set[int]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def add(self, conn_id: int, lease: Lease) -> HeldLease:
        h = HeldLease(next(self._ids), conn_id, lease)
        self._held[h.lease_id] = h
        self._by_conn.setdefault(conn_id, set()).add(h.lease_id)
        return h

    def renew(self, conn_id: int, lease_id: int) -> bool:
        h = self._held.get(lease_id)
        if h is None or h.conn_id != conn_id:
            return False
        h.renewed = time.monotonic()
        return True

    def take(self, conn_id: int, lease_id: int) -> Lease | None:
        """Remove one lease of ``conn_id`` (None: unknown, expired, or another's)."""
        h = self._held.get(lease_id)
        if h is None or h.conn_id != conn_id:
            return None
        return self._remove(h)

    def take_connection(self, conn_id: int) -> list[Lease]:
        """Remove every lease of a connection that ended."""
        return [self._remove(self._held[i]) for i in sorted(self._by_conn.get(conn_id, ()))]

    def take_expired(self, now: float | None = None) -> list[tuple[HeldLease, Lease]]:
        now = time.monotonic() if now is None else now
        old = [h for h in self._held.values() if now - h.renewed > self.timeout_s]
        return [(h, self._remove(h)) for h in old]

    def count(self, conn_id: int) -> int:
        return len(self._by_conn.get(conn_id, ()))

    def _remove(self, h: HeldLease) -> Lease:
        del self._held[h.lease_id]
        ids = self._by_conn[h.conn_id]
        ids.discard(h.lease_id)
        if not ids:
            del self._by_conn[h.conn_id]
        return h.lease

    def check_integrity(self) -> None:
        grouped = {i for ids in self._by_conn.values() for i in ids}
        assert grouped == set(self._held), "lease ids by connection disagree with the held leases"
        for conn, ids in self._by_conn.items():
            assert ids and all(self._held[i].conn_id == conn for i in ids)


class StagingSlots:
    """Slots of the daemon-wide staging region, each owned by one connection while the
    client writes a page into it and until the commit that stores it returns.
    Per-connection quota: ``quota`` slots."""

    def __init__(self, capacity: int, quota: int) -> None:
        self.slots = SlotAllocator(capacity)
        self.quota = min(quota, capacity)
        self._owner: dict[int, int] = {}  # slot -> conn id
        self._by_conn: dict[int, set[int]] = {}

    def alloc(self, conn_id: int, n: int) -> list[int] | None:
        """``n`` slots for ``conn_id``, or None when its quota or the region is exhausted."""
        mine = self._by_conn.setdefault(conn_id, set())
        if len(mine) + n > self.quota or self.slots.num_free < n:
            if not mine:
                del self._by_conn[conn_id]
            return None
        got = [self.slots.alloc() for _ in range(n)]
        for s in got:
            assert s is not None
            self._owner[s] = conn_id
            mine.add(s)
        return got  # type: ignore[return-value]

    def owns(self, conn_id: int, slots: tuple[int, ...]) -> bool:
        return len(set(slots)) == len(slots) and all(self._owner.get(s) == conn_id for s in slots)

    def free(self, conn_id: int, slots: tuple[int, ...] | list[int]) -> None:
        for s in slots:
            if self._owner.get(s) != conn_id:
                continue
            del self._owner[s]
            self._by_conn[conn_id].discard(s)
            self.slots.free(s)
        if conn_id in self._by_conn and not self._by_conn[conn_id]:
            del self._by_conn[conn_id]

    def free_connection(self, conn_id: int) -> None:
        self.free(conn_id, list(self._by_conn.get(conn_id, ())))

    def check_integrity(self) -> None:
        self.slots.check_integrity()
        assert set(self._owner) == self.slots.used_slots(), "staging owners disagree with the allocator"
        assert {s for ids in self._by_conn.values() for s in ids} == set(self._owner)
