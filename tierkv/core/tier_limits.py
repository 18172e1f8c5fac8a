"""Tier limits: fitting a store's tiers under lowered limits (``Store.set_tier_limits``).

A daemon maps each layout's tiers at its whole budgets and lets each use a share, a *limit*
(tierkv/daemon/layouts.py). A limit bounds a tier's count of used slots and their positions
(slots at or above it are never handed out), so the memory above it is never touched. When
a limit drops, :func:`fit_under_limits` brings each tier under it, with the store lock held:

1. the count: the normal eviction (the policy's victims, leaf first; demotion, write-back,
   eviction listeners, index first on disk) until the tier uses no more than its limit;
2. the positions: a memory-tier block still placed above the limit moves to a free slot
   below it (a copy within the tier: nothing is lost; nobody reads the slot of a block
   that is neither leased nor being read: clients read device slots only under a lease);
3. what could not move (no free slot below, or on disk, where a page lives in a segment
   file of its model version) is evicted, its extensions in the tier first (leaf first
   keeps prefixes whole).

Blocks that are leased, being read or pinned on disk (and their prefixes) stay where they
are; the tier then allocates only while its use is below the limit, and a later call (the
daemon retries every second) finishes the job.

Rejected: evicting by position only (measured: halving a full 256 MiB host tier of 32-block
chains left 32 MiB of its 128 MiB limit in use, because each block above the limit took its
extensions below it along); moving disk pages (a copy of every page above the limit, with
an index commit each, under the store lock, for pages that are on disk anyway).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ..tiers import TierName

if TYPE_CHECKING:
    from .blocks import Block
    from .placement import Placement

DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK


def fit_under_limits(placement: "Placement") -> int:
    """Bring every tier of ``placement`` under its limit as far as possible (held: the
    store lock); returns how many used slots are still above the limits."""
    for t in (DEVICE, HOST, DISK):
        _evict_to_count(placement, t)
        _move_or_evict_above(placement, t)
    return (len(placement.device.slots.used_above_limit()) + len(placement.host.slots.used_above_limit())
            + placement.disk.used_above_limit())


def _used_and_limit(placement: "Placement", t: TierName) -> tuple[int, int]:
    if t == DISK:
        disk = placement.disk
        return disk.num_used, disk.segment_limit * disk.segment_pages
    slots = placement.tier(t).slots
    return slots.num_used, slots.limit


def _evict_to_count(placement: "Placement", t: TierName) -> None:
    used, limit = _used_and_limit(placement, t)
    while used > limit:
        victim = placement.table.victim(t)
        if victim is None:
            return  # the rest is held: it stays until released
        placement.evict(victim, t)
        used, limit = _used_and_limit(placement, t)


def _move_or_evict_above(placement: "Placement", t: TierName) -> None:
    table = placement.table
    if t == DISK:
        above = placement.disk.over_limit
    else:
        above = placement.tier(t).slots.limit.__le__
    for b in [b for b in table.blocks.values() if t in b.loc and above(b.loc[t])]:
        if t not in b.loc or b.leases or b.busy:
            continue  # gone already (an extension of an earlier one), or held: it stays
        if t != DISK and _move_below(placement, b, t):
            continue
        order, todo = [], [b]  # b and its extensions in t, parents before children
        while todo:
            x = todo.pop()
            order.append(x)
            todo.extend(c for c in map(table.get, x.children) if c is not None and t in c.loc)
        for x in reversed(order):
            if t in x.loc and table.evictable(x, t):
                placement.evict(x, t)


def _move_below(placement: "Placement", b: "Block", t: TierName) -> bool:
    """Move ``b``'s page in memory tier ``t`` to a free slot below the limit; False when
    there is none. The block's place in the eviction order restarts (as after a demotion)."""
    tier = placement.tier(t)
    slot = tier.slots.alloc_below_limit()
    if slot is None:
        return False
    tier.write(slot, tier.page(b.loc[t]))
    old = placement.table.unplace(b, t)
    tier.slots.free(old)  # above the limit: its memory is given back (MemoryTier._discard)
    placement.table.place(b, t, slot)
    return True
