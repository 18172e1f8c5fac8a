"""Per-uid quotas and connection timeouts: one client (or one user) cannot lock the others
out of the daemon (issue 11, item 10; atomic and fair since issue 34, item 9).

Before, 256 idle or half-sent connections refused every other client; one client could
lease the whole device tier or hold every staging slot; clients that never read their
replies pinned daemon memory; and the 4,096-lease cap was checked before an ``await``, so
concurrent acquires passed it together (4,123 granted).

The limits (defaults in :class:`Quotas`, documented in docs/operations.md):

* connections per uid (``connections_per_uid``), beside the daemon-wide ``max_connections``;
* a connection holding nothing (no lease, no request in flight; staging slots do not count,
  issue #34 item 10) that sends nothing for ``idle_timeout_s`` is closed; once a frame's
  first byte arrived, the rest must arrive within ``frame_timeout_s`` (a half-sent frame
  holds a reader forever); staging slots not committed within the daemon's
  ``staging_timeout_s`` are taken back (leases.py, StagingSlots);
* leases: at most ``leases_per_connection``, counted with the acquires in flight (a
  reservation is taken before the store call, so concurrent acquires cannot pass the cap
  together); and while other uids are connected no uid may lease more than its fair share
  of the device tier's slots: ``shared_tier_fraction``, and at most ``1/k`` with ``k``
  uids connected (checked with the blocks actually leased, before the lease is handed out;
  over the share, it is released and refused). A uid above its share when others arrive
  keeps its leases, but may not renew them (they expire after ``lease_timeout_s``);
* staging: while other uids are connected no uid may hold more than its fair share
  (``shared_staging_fraction``, at most ``1/k``) of the staging region;
* pinned blocks (they never leave the disk tier, so pinned junk evicts everyone else).
  Pins outlive connections, so on a daemon that admits other uids (``allowed_uids``) the
  rule holds whether or not they are connected now: all pinned blocks of a layout together
  stay within ``shared_pinned_fraction`` of its disk slots (the rest stays evictable, so a
  uid that arrives later still gets durable puts; two namespaces of one uid used to pin
  100%), and under ``namespace_per_uid`` a uid's own within its fair share of that (at
  most ``1/k`` with ``k`` uids connected). The check and the pin are one step: pins are
  checked and stored under one lock (16 concurrent pinned puts used to pass a check made
  before an ``await`` together: 1,600 pinned against 1,024). A daemon of one user, with no
  other uid admitted, checks nothing;
* layouts: another uid may make at most ``layouts_per_uid`` new layouts (each takes an
  equal part of every budget from the layouts already open, and stays, also across a
  restart: three junk layouts of another uid cut the real model to a quarter of every tier
  and the next real model was refused); who made a layout is kept beside its store
  (``CREATOR``), so the count survives a restart. The daemon's own uid is bound only by
  ``max_layouts``;
* unread replies: a connection whose replies wait unread beyond ``unread_reply_bytes`` is
  not read from until they drain, and one whose peer reads nothing for ``send_timeout_s``
  is closed (its leases are released).

Each refusal raises QuotaExceededError (a CapacityError) with the limit that refused it,
and is counted in ``tierkv_quota_refusals_total{quota=...}``; closed connections are counted
in ``tierkv_rejected_connections_total{reason=...}``.

The numbers are kept by their owners (LeaseTable, StagingSlots, the server's connection
table); this module holds the rules.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

from ..errors import QuotaExceededError

MiB = 1 << 20


@dataclass(frozen=True)
class Quotas:
    connections_per_uid: int = 64
    idle_timeout_s: float = 30.0
    frame_timeout_s: float = 10.0
    send_timeout_s: float = 30.0
    unread_reply_bytes: int = 64 * MiB
    leases_per_connection: int = 4096
    shared_tier_fraction: float = 0.5
    shared_staging_fraction: float = 0.5
    shared_pinned_fraction: float = 0.5
    layouts_per_uid: int = 1  # new layouts another uid may make (the daemon's own uid: max_layouts)

    def __post_init__(self) -> None:
        if self.layouts_per_uid < 0:
            raise ValueError("layouts_per_uid must be at least 0")
        for name in ("connections_per_uid", "unread_reply_bytes", "leases_per_connection"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        for name in ("idle_timeout_s", "frame_timeout_s", "send_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("shared_tier_fraction", "shared_staging_fraction", "shared_pinned_fraction"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in (0, 1]")


class QuotaRules:
    """The checks; each raises QuotaExceededError and counts the refusal by name."""

    def __init__(self, quotas: Quotas, on_refuse: Callable[[str], None] | None = None) -> None:
        self.quotas = quotas
        self.refusals: Counter[str] = Counter()
        self.on_refuse = on_refuse  # the metric of each refusal

    def refuse(self, quota: str, message: str, hint: str | None = None) -> QuotaExceededError:
        self.count(quota)
        return QuotaExceededError(message, hint=hint)

    def count(self, quota: str) -> None:
        """Count a refusal by ``quota`` (one made here or by the quota's owner)."""
        self.refusals[quota] += 1
        if self.on_refuse is not None:
            self.on_refuse(quota)

    @staticmethod
    def others_connected(uid: int, uids: Iterable[int]) -> bool:
        return any(u != uid for u in uids)

    @staticmethod
    def fair_limit(capacity: int, fraction: float, uid: int, uids: Iterable[int]) -> int:
        """What one uid may hold of ``capacity`` with ``uids`` connected: ``fraction`` of
        it, and no more than an equal part among the distinct uids (so a share shrinks as
        others arrive: with three users each gets a third, not a half)."""
        k = len(set(uids) | {uid})
        return max(1, int(capacity * min(fraction, 1.0 / k)))

    def check_connection(self, uid: int, uids: Iterable[int]) -> None:
        """Before admitting a connection of ``uid``; ``uids`` are those already connected."""
        n = sum(1 for u in uids if u == uid)
        if n >= self.quotas.connections_per_uid:
            raise self.refuse("connections", f"uid {uid} has {n} connections to the daemon already "
                              f"(connections_per_uid = {self.quotas.connections_per_uid})",
                              hint="close idle connections, or share one client between threads")

    def check_lease(self, uid: int, uids: Iterable[int], conn_leases: int, uid_blocks: int, tier_slots: int) -> None:
        """Before an acquire by ``uid``, whose connection holds (or is acquiring)
        ``conn_leases`` leases and whose connections hold ``uid_blocks`` leased blocks of a
        device tier of ``tier_slots`` slots: the lease cap, and a uid already at its share."""
        q = self.quotas
        if conn_leases >= q.leases_per_connection:
            raise self.refuse("leases", f"this connection holds {conn_leases} leases "
                              f"(leases_per_connection = {q.leases_per_connection})", hint="release some first")
        self.check_leased_blocks(uid, uids, uid_blocks, 1, tier_slots)

    def check_leased_blocks(self, uid: int, uids: Iterable[int], uid_blocks: int, want_blocks: int,
                            tier_slots: int) -> None:
        """Whether ``uid`` may hold ``want_blocks`` more leased blocks. Checked after the
        store call with what was actually leased (a long prompt mostly not stored must not
        be refused for its length), before the lease enters the table: on the loop thread,
        so concurrent acquires are counted one after the other. ``want_blocks`` 0 asks
        whether what it holds is within its share (a renewal)."""
        uids = list(uids)
        if self.others_connected(uid, uids):
            limit = self.fair_limit(tier_slots, self.quotas.shared_tier_fraction, uid, uids)
            if uid_blocks + want_blocks > limit:
                raise self.refuse("leased_blocks", f"uid {uid} would lease {uid_blocks + want_blocks} blocks of the "
                                  f"device tier's {tier_slots} while {len(set(uids) | {uid})} users are connected "
                                  f"(its fair share is {limit}: shared_tier_fraction = "
                                  f"{self.quotas.shared_tier_fraction:g}, at most an equal part)",
                                  hint="release leases first, or lease a window (max_blocks) at a time")

    def check_staging(self, uid: int, uids: Iterable[int], uid_slots: int, want: int, capacity: int) -> None:
        uids = list(uids)
        if self.others_connected(uid, uids):
            limit = self.fair_limit(capacity, self.quotas.shared_staging_fraction, uid, uids)
            if uid_slots + want > limit:
                raise self.refuse("staging", f"uid {uid} would hold {uid_slots + want} of the {capacity} staging "
                                  f"slots while {len(set(uids) | {uid})} users are connected (its fair share is "
                                  f"{limit}: shared_staging_fraction = {self.quotas.shared_staging_fraction:g}, "
                                  "at most an equal part)",
                                  hint="put fewer blocks at once; commit or unstage what is held")

    def check_pinned(self, uid: int, uids: Iterable[int], pinned: "PinnedCounts", want: int, disk_slots: int) -> None:
        """Before pinning up to ``want`` more blocks, with ``pinned`` counted under the pin
        lock: the layout's pinned total within ``shared_pinned_fraction`` of its
        ``disk_slots``, and a tenant's own (when there is one: ``namespace_per_uid``) within
        its fair share of that."""
        fraction = self.quotas.shared_pinned_fraction
        hint = "unpin or invalidate prefixes you no longer need (tierkv unpin, invalidate)"
        total = max(1, int(disk_slots * fraction))
        if pinned.total + want > total:
            raise self.refuse("pinned", f"{pinned.total + want} blocks of the disk tier's {disk_slots} would be "
                              f"pinned (at most {total} on a daemon other users share: shared_pinned_fraction = "
                              f"{fraction:g})", hint=hint)
        if pinned.tenant is not None:
            uids = list(uids)
            limit = self.fair_limit(total, 1.0, uid, uids)
            if pinned.own + want > limit:
                raise self.refuse("pinned", f"{pinned.tenant!r} would pin {pinned.own + want} blocks of the disk "
                                  f"tier's {disk_slots} with {len(set(uids) | {uid})} users connected (its fair "
                                  f"share of the {total} pinnable is {limit}: shared_pinned_fraction = "
                                  f"{fraction:g}, an equal part)", hint=hint)


@dataclass(frozen=True)
class PinnedCounts:
    """Pinned blocks of a layout, counted for :meth:`QuotaRules.check_pinned`: all of them,
    and those of ``tenant`` (a uid's namespace prefix; None when namespaces are shared)."""

    total: int
    tenant: str | None = None
    own: int = 0
