"""The lease requests of the daemon: acquire (answered on the loop when it can finish now,
else in a worker), release (one-way, ended on the loop or queued for the next store call:
workers.py), renew, and the ending of a connection's or an expired lease.

:class:`LeaseHandlers` is a part of :class:`~tierkv.daemon.handlers.Handlers`, which owns
the lease table, the quota rules and the workers and hands them in; this class owns only
the count of where acquires ran.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable, Sequence

from ..errors import LeaseError, QuotaExceededError
from ..identity import Scope
from ..lease import Lease
from . import messages as m
from .messages import Answer
from .layouts import LayoutEntry, Layouts, ServedStore
from .leases import LeaseTable
from .quotas import QuotaRules
from .tenant_regions import TenantRegions
from .workers import Workers

if TYPE_CHECKING:
    from .connection import Connection

log = logging.getLogger("tierkv.daemon.handlers")  # the request handlers' log
INLINE_MAX_BLOCKS = 1024  # longer prompts are acquired in a worker even when resident


def _acquire(store: ServedStore, msg: m.PrefixRequest, scope: Scope, max_blocks: int | None) -> Lease:
    """``store.acquire`` of ``msg``'s prefix; a miss (no blocks) is released at once, so it
    holds nothing."""
    lease = store.acquire(msg.tokens, scope, msg.block_extra, max_blocks, msg.start_block)
    if not lease.keys:
        store.release(lease)
    return lease


def inline_ok(entry: LayoutEntry, msg: m.PrefixRequest) -> bool:
    """Whether a prefix request may be served on the event loop (an acquire's, a lookup's):
    the store is the local one (a cluster node may ask its peers) and the prompt is at most
    ``INLINE_MAX_BLOCKS`` blocks (~0.4 us each: the loop is busy that long)."""
    return entry.store is entry.local and len(msg.tokens) <= INLINE_MAX_BLOCKS * entry.layout.block_size


class LeaseHandlers:
    """Acquire, release, renew; ending a connection's leases and expired ones."""

    def __init__(self, layouts: Layouts, leases: LeaseTable, quota: QuotaRules, workers: Workers, *,
                 entry: Callable[["Connection"], LayoutEntry], scope: Callable[["Connection", m.WireScope], Scope],
                 peers: Callable[[], list[tuple[int, int]]]) -> None:
        """``entry``, ``scope``: the layout and the store scope of a connection's request
        (Handlers); ``peers``: (connection id, uid) of every connection (the daemon's)."""
        self.layouts = layouts
        self.leases = leases
        self.quota = quota
        self.workers = workers
        self.run = workers.run
        self.entry = entry
        self.scope = scope
        self.peers = peers
        self.acquires = {"inline": 0, "worker": 0}  # where acquires ran (daemon stats)

    def acquire_now(self, conn: "Connection", msg: m.PrefixRequest) -> Answer | None:
        """The acquire, when it can be done here on the event loop without waiting (see
        :meth:`_acquire_inline`): the server calls it as the request is read, with no task
        and no extra turn of the loop. None, with nothing done, when it must wait: the
        server then runs :meth:`acquire` in a task."""
        if conn.tenant is not None:
            return None  # a tenant's pages are copied into its read window: a worker's job
        entry, uid, uids, tier = self._acquire_checks(conn)
        # No reservation: nothing else runs on the loop between the checks and the entry.
        lease = self._acquire_inline(entry, msg, self.scope(conn, msg.scope))
        if lease is None:
            return None
        self.acquires["inline"] += 1
        return self._lease_reply(conn, uid, uids, tier, lease)

    async def acquire(self, conn: "Connection", msg: m.PrefixRequest) -> Answer:
        """The acquire in a worker: the server runs it when :meth:`acquire_now`, which it
        tries first as the request is read, could not finish at once."""
        entry, uid, _, tier = self._acquire_checks(conn)
        # The lease is counted from before the store call, so acquires in flight count: the
        # cap was checked before an await and concurrent acquires passed it together.
        reservation = self.leases.reserve(conn.id, uid, 0)
        try:
            self.acquires["worker"] += 1
            max_blocks = msg.max_blocks
            if conn.tenant is not None:  # no longer than its read window has room for
                room = conn.tenant.read_free
                max_blocks = room if max_blocks is None else min(max_blocks, room)
            lease = await self.run(_acquire, entry.store, msg, self.scope(conn, msg.scope), max_blocks)
            if conn.tenant is not None and lease.keys:
                return await self._tenant_lease_reply(conn, conn.tenant, uid, tier, entry, lease)
            return self._lease_reply(conn, uid, [u for _, u in self.peers()], tier, lease)
        finally:
            self.leases.unreserve(reservation)

    def _acquire_checks(self, conn: "Connection") -> tuple[LayoutEntry, int, list[int], int]:
        """The connection's layout, uid, the uids connected, and its device tier share in
        slots, once the lease quotas allow an acquire (QuotaExceededError otherwise)."""
        entry, uid = self.entry(conn), conn.creds.uid
        tier = int(entry.local.device.slots.limit)  # this layout's share of the device tier
        uids = [u for _, u in self.peers()]
        self.quota.check_lease(uid, uids, self.leases.count(conn.id), self.leases.blocks_of(uid), tier)
        return entry, uid, uids, tier

    def _lease_reply(self, conn: "Connection", uid: int, uids: list[int], tier: int, lease: Lease) -> Answer:
        """Enter a store lease in the lease table (a miss holds nothing: lease id 0, no
        entry) and encode the reply, once the uid's tier share allows what was leased."""
        if lease.keys:
            try:  # the tier share, with what was leased (quotas.py)
                self.quota.check_leased_blocks(uid, uids, self.leases.blocks_of(uid), lease.num_blocks, tier)
            except QuotaExceededError:
                self.workers.release_later([lease])
                raise
        lease_id = self.leases.add(conn.id, lease, uid).lease_id if lease.keys else 0
        return m.KeysReply(lease.keys, {"lease_id": lease_id}, tuple(lease.slots)).encode()

    async def _tenant_lease_reply(self, conn: "Connection", tenant: TenantRegions, uid: int, tier: int,
                                  entry: LayoutEntry, lease: Lease) -> Answer:
        """A tenant's lease: its pages copied into the connection's read window (by a worker:
        up to its size of memory), and the reply naming those slots; they are freed when the
        lease ends, however it ends (LeaseTable's ``on_end``)."""
        try:
            self.quota.check_leased_blocks(uid, [u for _, u in self.peers()], self.leases.blocks_of(uid),
                                           lease.num_blocks, tier)
            window = await self.run(tenant.copy_in, entry.local.device.pool, lease.slots)
        except BaseException:
            self.workers.release_later([lease])
            raise
        held = self.leases.add(conn.id, lease, uid, on_end=lambda: tenant.free(window))
        return m.KeysReply(lease.keys, {"lease_id": held.lease_id}, tuple(window)).encode()

    def _acquire_inline(self, entry: LayoutEntry, msg: m.PrefixRequest, scope: Scope) -> Lease | None:
        """The acquire done here on the event loop when it cannot wait on anything: no
        release is queued (a connection's request must see its own releases done), the
        store is the local one (a cluster node may fetch), the prompt is at most
        ``INLINE_MAX_BLOCKS`` blocks (~0.4 us each: the loop is busy that long), and
        ``Store.acquire_resident`` finds the lock free and every block in the device tier.
        None when any of that fails: the caller goes through a worker. A miss is released
        here (it holds nothing)."""
        if self.workers.unreleased or not inline_ok(entry, msg):
            return None
        lease = entry.local.acquire_resident(msg.tokens, scope, msg.block_extra, msg.max_blocks, msg.start_block)
        if lease is not None and not lease.keys:
            self.workers.release_soon([lease])
        return lease

    def release_oneway(self, conn: "Connection", msg: m.Release) -> bool:
        """A release that wants no reply, done now (fast_path.py); False, with nothing
        done, for one that wants a reply (:meth:`release` then runs in the read loop)."""
        if msg.reply:
            return False
        unknown = self._take_and_release(conn, msg.lease_ids)
        if unknown:
            log.info("connection %d: %s", conn.id, self._not_held(unknown))
        return True

    def _take_and_release(self, conn: "Connection", lease_ids: Sequence[int]) -> list[int]:
        """Take ``conn``'s leases ``lease_ids`` and release them soon; returns the ids it
        does not hold."""
        taken = [(i, self.leases.take(conn.id, i)) for i in lease_ids]
        self.workers.release_soon([lease for _, lease in taken if lease is not None])
        return [i for i, lease in taken if lease is None]

    def _not_held(self, unknown: list[int]) -> str:
        return (f"lease {', '.join(map(str, unknown))} is not held by this connection (released, or expired "
                f"after {self.leases.timeout_s:g} s without renew)")

    async def release(self, conn: "Connection", msg: m.Release) -> Answer | None:
        if self.release_oneway(conn, msg):
            return None  # the client waits for nothing
        unknown = self._take_and_release(conn, msg.lease_ids)
        if unknown:
            raise LeaseError(self._not_held(unknown))
        await self.workers.settle()
        return {}, b""

    async def renew(self, conn: "Connection", msg: m.LeaseRef) -> Answer:
        # A uid holding more than its fair share (others arrived since it leased) keeps its
        # leases until they end or expire, but may not renew them (issue 34, item 9: a uid
        # alone leased the whole tier and kept it, and later uids got acquires of 0 blocks).
        entry, uid = self.entry(conn), conn.creds.uid
        self.quota.check_leased_blocks(uid, [u for _, u in self.peers()], self.leases.blocks_of(uid), 0,
                                       int(entry.local.device.slots.limit))
        if not self.leases.renew(conn.id, msg.lease_id):
            raise LeaseError(f"lease {msg.lease_id} is not held by this connection (released or expired)")
        return {}, b""

    # ---- ending leases ------------------------------------------------------------------------
    async def release_all(self, leases: list[Lease]) -> None:
        """Release store leases taken out of the table (dead connection, timeout)."""
        self.workers.release_later(leases)
        await self.workers.settle()

    async def end_connection(self, conn: "Connection") -> int:
        leases = self.leases.take_connection(conn.id)
        for e in self.layouts.entries():  # a connection without HELLO may have staged on the only layout
            e.staging.free_connection(conn.id)
        if conn.tenant is not None:  # its mappings lose their backing pages with the files
            conn.tenant.close()
        await self.release_all(leases)
        return len(leases)

    async def expire_leases(self) -> int:
        expired = self.leases.take_expired()
        for h, _ in expired:
            log.warning("lease %d of connection %d expired after %.0f s without renew; released",
                        h.lease_id, h.conn_id, self.leases.timeout_s)
        await self.release_all([lease for _, lease in expired])
        return len(expired)
