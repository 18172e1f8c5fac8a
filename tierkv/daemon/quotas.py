"""Per-uid quotas and connection timeouts: one client (or one user) cannot lock the others
out of the daemon (issue 11, item 10).

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
  together); and while another uid is connected no uid may lease more than
  ``shared_tier_fraction`` of the device tier's slots (checked with the blocks actually
  leased, before the lease is handed out; over the share, it is released and refused);
* staging: while another uid is connected no uid may hold more than
  ``shared_staging_fraction`` of the staging region;
* pinned blocks (they never leave the disk tier, so pinned junk evicts everyone else):
  while another uid is connected, a tenant (a uid under ``namespace_per_uid``, else a
  namespace) may pin at most ``shared_pinned_fraction`` of the disk tier's slots;
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

    def __post_init__(self) -> None:
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
        self.refusals[quota] += 1
        if self.on_refuse is not None:
            self.on_refuse(quota)
        return QuotaExceededError(message, hint=hint)

    @staticmethod
    def others_connected(uid: int, uids: Iterable[int]) -> bool:
        return any(u != uid for u in uids)

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
        so concurrent acquires are counted one after the other."""
        q = self.quotas
        if self.others_connected(uid, uids):
            limit = max(1, int(tier_slots * q.shared_tier_fraction))
            if uid_blocks + want_blocks > limit:
                raise self.refuse("leased_blocks", f"uid {uid} would lease {uid_blocks + want_blocks} blocks of the "
                                  f"device tier's {tier_slots} while other users are connected (at most {limit}: "
                                  f"shared_tier_fraction = {q.shared_tier_fraction:g})",
                                  hint="release leases first, or lease a window (max_blocks) at a time")

    def check_staging(self, uid: int, uids: Iterable[int], uid_slots: int, want: int, capacity: int) -> None:
        if self.others_connected(uid, uids):
            limit = max(1, int(capacity * self.quotas.shared_staging_fraction))
            if uid_slots + want > limit:
                raise self.refuse("staging", f"uid {uid} would hold {uid_slots + want} of the {capacity} staging "
                                  f"slots while other users are connected (at most {limit}: "
                                  f"shared_staging_fraction = {self.quotas.shared_staging_fraction:g})",
                                  hint="put fewer blocks at once; commit or unstage what is held")


    def check_pinned(self, uid: int, uids: Iterable[int], tenant: str, pinned: int, want: int, disk_slots: int) -> None:
        """Before pinning up to ``want`` more blocks of ``tenant`` (a namespace prefix),
        which holds ``pinned`` pinned blocks of a disk tier of ``disk_slots`` slots."""
        if self.others_connected(uid, uids):
            limit = max(1, int(disk_slots * self.quotas.shared_pinned_fraction))
            if pinned + want > limit:
                raise self.refuse("pinned", f"{tenant!r} would pin {pinned + want} blocks of the disk tier's "
                                  f"{disk_slots} while other users are connected (at most {limit}: "
                                  f"shared_pinned_fraction = {self.quotas.shared_pinned_fraction:g})",
                                  hint="unpin or invalidate prefixes you no longer need (tierkv unpin, invalidate)")


