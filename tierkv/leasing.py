"""Leasing: ``acquire`` and ``release``, the bookkeeping of leases around the reads.

:class:`Leasing` is given the store that owns it (a :class:`~tierkv.results.Lease` names
its store, which releases it), the :class:`~tierkv.placement.Placement` (lock, table,
tiers) and the :class:`~tierkv.promotion.Promotion` (the reads into the device tier).

Ownership: ``acquire`` leases each block of the window under the store lock before any
read starts, so nothing evicts, moves or frees a block it is about to hand out; a block
that cannot be brought into the device tier ends the lease there, and its lease (and those
after it) are dropped before ``acquire`` returns. Whatever fails after a block was leased,
the leases taken are dropped before the error leaves (``ended=False``: a lease never handed
out does not count as a use). A lease handed out is released exactly once
(:meth:`Leasing.release`; a second release is a :class:`~tierkv.errors.LeaseError`).
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from .blocks import Block
from .errors import LeaseError
from .identity import Scope
from .matching import match_chain
from .placement import Placement
from .promotion import PlannedRead, Promotion
from .read_through import ReadThrough
from .results import Lease
from .tiers import TierName
from .tiers.base import TIER_KEY

DEVICE = TierName.DEVICE
DEVICE_KEY = TIER_KEY[DEVICE]  # Block.loc's key (tiers.base.TIER_KEY)

if TYPE_CHECKING:
    from .store import Store


class Leasing:
    """The store's leases: acquire (in one pass when every block is resident, else with
    promotion), acquire only if it can finish now, release."""

    def __init__(self, store: "Store", placement: Placement, promotion: Promotion, read_through: ReadThrough) -> None:
        self.store = store
        self.placement, self.promotion, self.read_through = placement, promotion, read_through
        self.layout, self._lock = placement.layout, placement.lock
        self.table = placement.table

    def window(self, arr: np.ndarray, scope: Scope, block_extra: Sequence[Sequence[str | bytes]] | None,
               max_blocks: int | None, start_block: int) -> list[Block]:
        """The matched chain's blocks ``start_block .. start_block + max_blocks`` (held: the lock)."""
        if start_block < 0:
            raise ValueError("start_block must be >= 0")
        chain = match_chain(self.placement, arr, scope, block_extra)[start_block:]
        return chain if max_blocks is None else chain[:max_blocks]

    def asked(self, arr: np.ndarray, max_blocks: int | None, start_block: int) -> int:
        """How many full blocks an acquire of ``arr`` asks for: those of its window (the
        denominator of the acquire hit rate in stats)."""
        n = max(0, len(arr) // self.layout.block_size - start_block)
        return n if max_blocks is None else min(n, max(0, max_blocks))

    def lease_of(self, chain: list[Block], start_block: int, slots: list[int] | None = None) -> Lease:
        """The lease of ``chain``, every block leased and in the device tier (``slots``:
        their device slots, when the caller has them already)."""
        if slots is None:
            slots = [b.loc[DEVICE_KEY] for b in chain]
        return Lease(store=self.store, layout=self.layout, keys=tuple([b.key for b in chain]), slots=tuple(slots),
                     pool=self.placement.device.pool, blocks=chain, start_block=start_block)

    def acquire(self, arr: np.ndarray, scope: Scope, block_extra: Sequence[Sequence[str | bytes]] | None,
                max_blocks: int | None, start_block: int, promote: bool = True) -> Lease:
        """:meth:`tierkv.store.Store.acquire` of validated token ids ``arr``."""
        placement, promotion, table = self.placement, self.promotion, self.table
        with self._lock:
            chain = self.window(arr, scope, block_extra, max_blocks, start_block)
            table.touch_chain(chain)
            through = not promote and self.read_through.wants(chain)
            if through:  # read into the lease's own buffer (tierkv/read_through.py)
                for b in chain:
                    table.lease(b)  # before any read: nothing evicts or frees these disk slots
            else:
                plan: list[PlannedRead] = []
                waits: list[tuple[int, threading.Event]] = []
                # The blocks already in the device tier are leased at once (nothing is evicted
                # for them); from the first that is not, block by block: blocks further along
                # the chain are not leased yet, so making room may evict them; the lease stops
                # where the device tier is full.
                resident = table.lease_resident(chain, DEVICE)
                leased = len(resident)
                try:
                    for i in range(leased, len(chain)):
                        b = chain[i]
                        if b.dead or not b.loc:
                            # Making room for an earlier block evicted this one from every tier.
                            chain = chain[:i]
                            break
                        table.lease(b)
                        leased = i + 1
                        if DEVICE_KEY in b.loc:
                            continue
                        in_flight = promotion.read_of(b.key)
                        if in_flight is not None:
                            waits.append((i, in_flight))
                            continue
                        slot = placement.alloc_mem(DEVICE)
                        if slot is None:
                            placement.release_blocks([b], ended=False)
                            chain = chain[:i]
                            break
                        plan.append(promotion.plan_read(i, b, slot))
                except BaseException:
                    # Making room failed (the index could not record an eviction): undo this
                    # acquire's leases and plans so that nothing stays pinned or waited on.
                    try:
                        promotion.settle(plan)  # nothing was read: every slot freed, every waiter woken
                    finally:
                        placement.release_blocks(chain[:leased], ended=False)
                    raise
                asked = self.asked(arr, max_blocks, start_block)
                if len(resident) == len(chain):  # all in the device tier: nothing to read or wait for
                    placement.stats_counters.record_acquire_resident(len(chain), asked)
                    return self.lease_of(chain, start_block, resident)
                # Where each block was found; counted once the reads have settled, for the blocks
                # the lease holds then (a page that fails its read or checksum is not a hit).
                tops = [b.top for b in chain]
                if not plan and not waits:  # every leased block is in the device tier (the chain was cut short)
                    placement.stats_counters.record_acquire(tops, asked)
                    return self.lease_of(chain, start_block)
        if through:
            return self.read_through.acquire(chain, start_block, self.asked(arr, max_blocks, start_block))
        try:
            failed = promotion.promote(plan)
            failed = promotion.await_reads(waits, chain, failed)
        except BaseException:
            with self._lock:
                placement.release_blocks(chain, ended=False)  # the lease is never handed out
            raise
        with self._lock:
            if failed is not None:
                placement.release_blocks(chain[failed:], ended=False)
                chain = chain[:failed]
            placement.stats_counters.record_acquire(tops[: len(chain)], asked)
        return self.lease_of(chain, start_block)

    def acquire_resident(self, arr: np.ndarray, scope: Scope, block_extra: Sequence[Sequence[str | bytes]] | None,
                         max_blocks: int | None, start_block: int) -> Lease | None:
        """:meth:`tierkv.store.Store.acquire_resident` of validated token ids ``arr``."""
        if not self._lock.acquire(blocking=False):
            return None
        try:
            chain = self.window(arr, scope, block_extra, max_blocks, start_block)
            table = self.table
            slots = table.lease_resident(chain, DEVICE)
            if len(slots) != len(chain):  # a block to read or to wait for: not now
                table.unlease_many(chain[: len(slots)])  # none is dead (lease_resident stops there)
                return None
            table.touch_chain(chain)
            self.placement.stats_counters.record_acquire_resident(len(chain), self.asked(arr, max_blocks, start_block))
            return self.lease_of(chain, start_block, slots)
        finally:
            self._lock.release()

    def _check_owner(self, lease: Any) -> None:
        if lease.store is not self.store:
            raise LeaseError("lease released on a store that did not issue it")

    def release(self, lease: Lease) -> None:
        self._check_owner(lease)
        with self._lock:
            self._release_held(lease)

    def try_release(self, lease: Lease) -> bool:
        self._check_owner(lease)
        if not self._lock.acquire(blocking=False):
            return False
        try:
            self._release_held(lease)
        finally:
            self._lock.release()
        return True

    def _release_held(self, lease: Lease) -> None:
        if lease.released:
            raise LeaseError("lease released twice")
        lease.released = True
        try:
            self.placement.release_blocks(lease.blocks)
        finally:
            if lease.read_through is not None:
                self.read_through.released(lease)
