"""Leases and staging slots held by daemon connections.

A store lease taken for a client belongs to that client's connection: when the connection
ends (the client closed it, exited or was killed, the kernel closes the socket either way)
every lease it still holds is released, so a dead client never pins blocks. A lease not
renewed for ``timeout_s`` is released too (a hung client). A staging slot not committed
within the daemon's ``staging_timeout_s`` is taken back (:class:`StagingSlots`).

Both tables are touched only from the event loop thread; the store calls that end a lease
run in worker threads, so the methods here *take the leases out* and the caller releases
them in the store.
"""
from __future__ import annotations

import itertools
import time
from collections import Counter
from typing import Callable, Iterable
from dataclasses import dataclass, field

from ..results import Lease
from ..tiers.base import SlotAllocator


@dataclass
class HeldLease:
    lease_id: int
    conn_id: int
    lease: Lease
    renewed: float = field(default_factory=time.monotonic)
    uid: int = -1
    on_end: Callable[[], None] | None = None  # run when it leaves the table, however it leaves


@dataclass(frozen=True)
class Reservation:
    """Room taken for an acquire in flight (see quotas.py): one lease of ``blocks``."""

    conn_id: int
    uid: int
    blocks: int


class LeaseTable:
    """Lease id -> store lease, grouped by connection. Only :meth:`add` and :meth:`take*`
    move a lease in or out. Per uid it counts leased blocks, and per connection and uid
    the acquires in flight (:meth:`reserve`), which the quota rules count as held."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._held: dict[int, HeldLease] = {}
        self._by_conn: dict[int, set[int]] = {}
        self._blocks_by_uid: Counter[int] = Counter()
        self._reserved_leases: Counter[int] = Counter()  # conn id -> acquires in flight
        self._reserved_blocks: Counter[int] = Counter()  # uid -> blocks of acquires in flight

    def __len__(self) -> int:
        return len(self._held)

    def reserve(self, conn_id: int, uid: int, blocks: int) -> Reservation:
        r = Reservation(conn_id, uid, blocks)
        self._reserved_leases[conn_id] += 1
        self._reserved_blocks[uid] += blocks
        return r

    def unreserve(self, r: Reservation) -> None:
        self._reserved_leases[r.conn_id] -= 1
        self._reserved_blocks[r.uid] -= r.blocks
        for c, k in ((self._reserved_leases, r.conn_id), (self._reserved_blocks, r.uid)):
            if c[k] <= 0:
                del c[k]

    def blocks_of(self, uid: int) -> int:
        """Blocks leased by ``uid``'s connections, counting acquires in flight."""
        return self._blocks_by_uid[uid] + self._reserved_blocks[uid]

    def add(self, conn_id: int, lease: Lease, uid: int = -1, on_end: Callable[[], None] | None = None) -> HeldLease:
        h = HeldLease(next(self._ids), conn_id, lease, uid=uid, on_end=on_end)
        self._held[h.lease_id] = h
        self._by_conn.setdefault(conn_id, set()).add(h.lease_id)
        self._blocks_by_uid[uid] += lease.num_blocks
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
        """Leases of ``conn_id``, counting its acquires in flight."""
        return len(self._by_conn.get(conn_id, ())) + self._reserved_leases[conn_id]

    def _remove(self, h: HeldLease) -> Lease:
        del self._held[h.lease_id]
        self._blocks_by_uid[h.uid] -= h.lease.num_blocks
        if self._blocks_by_uid[h.uid] <= 0:
            del self._blocks_by_uid[h.uid]
        ids = self._by_conn[h.conn_id]
        ids.discard(h.lease_id)
        if not ids:
            del self._by_conn[h.conn_id]
        if h.on_end is not None:
            h.on_end()
        return h.lease

    def check_integrity(self) -> None:
        grouped = {i for ids in self._by_conn.values() for i in ids}
        assert grouped == set(self._held), "lease ids by connection disagree with the held leases"
        for conn, ids in self._by_conn.items():
            assert ids and all(self._held[i].conn_id == conn for i in ids)
        per_uid: Counter[int] = Counter()
        for h in self._held.values():
            per_uid[h.uid] += h.lease.num_blocks
        assert +per_uid == +self._blocks_by_uid, "leased blocks per uid disagree with the held leases"


class StagingSlots:
    """Slots of the daemon-wide staging region, each owned by one connection while the
    client writes a page into it and until the commit that stores it returns.
    Per-connection quota: ``quota`` slots.

    Slots expire (issue #34, item 10): two silent connections held the whole region and
    every other uid's puts failed. A slot staged more than ``staging_timeout_s`` ago and not
    yet in a commit is taken back by :meth:`take_expired`; the connection's later COMMIT
    naming it is refused (:meth:`expired`) and stores nothing. A slot whose commit started
    never expires: the commit copies its bytes, so handing it to another client then could
    mix that client's page into this put."""

    def __init__(self, capacity: int, quota: int) -> None:
        self.slots = SlotAllocator(capacity)
        self.quota = min(quota, capacity)
        self._owner: dict[int, int] = {}  # slot -> conn id
        self._by_conn: dict[int, set[int]] = {}
        self._staged_at: dict[int, float] = {}  # slot -> when staged; absent: in a commit
        self._expired: dict[int, set[int]] = {}  # conn id -> its slots taken back (at most capacity)

    def alloc(self, conn_id: int, n: int, now: float | None = None) -> list[int] | None:
        """``n`` slots for ``conn_id``, or None when its quota or the region is exhausted."""
        mine = self._by_conn.setdefault(conn_id, set())
        if len(mine) + n > self.quota or self.slots.num_free < n:
            if not mine:
                del self._by_conn[conn_id]
            return None
        now = time.monotonic() if now is None else now
        got = [self.slots.alloc() for _ in range(n)]
        lost = self._expired.get(conn_id)
        for s in got:
            assert s is not None
            self._owner[s] = conn_id
            self._staged_at[s] = now
            mine.add(s)
            if lost is not None:
                lost.discard(s)  # its own again: a commit naming it is a commit of the new page
        return got  # type: ignore[return-value]

    def held_by(self, conn_ids: "Iterable[int]") -> int:
        """Slots held by these connections (a uid's, for its quota)."""
        return sum(len(self._by_conn.get(c, ())) for c in conn_ids)

    def owns(self, conn_id: int, slots: tuple[int, ...]) -> bool:
        return len(set(slots)) == len(slots) and all(self._owner.get(s) == conn_id for s in slots)

    def begin_commit(self, conn_id: int, slots: tuple[int, ...] | list[int]) -> None:
        """The commit of these slots (owned by ``conn_id``: checked by the caller) started:
        they no longer expire; :meth:`free` ends them as before."""
        for s in slots:
            assert self._owner.get(s) == conn_id, "commit of a slot the connection does not own"
            self._staged_at.pop(s, None)

    def expired(self, conn_id: int, slots: tuple[int, ...] | list[int]) -> bool:
        """Whether any of ``slots`` was ``conn_id``'s and was taken back by the timeout."""
        lost = self._expired.get(conn_id)
        return bool(lost) and any(s in lost for s in slots)  # type: ignore[operator]

    def take_expired(self, timeout_s: float, now: float | None = None) -> dict[int, list[int]]:
        """Free every slot staged more than ``timeout_s`` ago and not in a commit; returns
        them by connection (for the log)."""
        now = time.monotonic() if now is None else now
        old: dict[int, list[int]] = {}
        for s, t in self._staged_at.items():
            if now - t > timeout_s:
                old.setdefault(self._owner[s], []).append(s)
        for conn_id, slots in old.items():
            self.free(conn_id, slots)
            self._expired.setdefault(conn_id, set()).update(slots)
        return old

    def free(self, conn_id: int, slots: tuple[int, ...] | list[int]) -> None:
        for s in slots:
            if self._owner.get(s) != conn_id:
                continue
            del self._owner[s]
            self._staged_at.pop(s, None)
            self._by_conn[conn_id].discard(s)
            self.slots.free(s)
        if conn_id in self._by_conn and not self._by_conn[conn_id]:
            del self._by_conn[conn_id]

    def free_connection(self, conn_id: int) -> None:
        self.free(conn_id, list(self._by_conn.get(conn_id, ())))
        self._expired.pop(conn_id, None)

    def check_integrity(self) -> None:
        self.slots.check_integrity()
        assert set(self._owner) == self.slots.used_slots(), "staging owners disagree with the allocator"
        assert {s for ids in self._by_conn.values() for s in ids} == set(self._owner)
        assert set(self._staged_at) <= set(self._owner), "a free staging slot has a stage time"
        for conn_id, lost in self._expired.items():
            assert not lost & self._by_conn.get(conn_id, set()), "a slot both held and expired by one connection"
