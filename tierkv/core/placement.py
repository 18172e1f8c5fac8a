"""Placement: which tier a block's pages live in, and the only code that moves them.

:class:`Placement` owns the block table, the three tiers, the index, the store lock and the
eviction listeners; :class:`tierkv.core.store.Store` builds it, and the parts that read and write
pages (ingest, promotion, the store operations) are given it. Every method here runs with
``lock`` held and changes locations only through ``BlockTable.place`` / ``unplace`` paired
with the tiers' ``alloc`` / ``free``. Making room evicts the policy's victims (leaf first,
:meth:`BlockTable.victim`); a block evicted from memory moves one tier down (device -> host,
or write-back to disk when it has no copy below), never silently lost while a tier below
can take it. Write-back takes a block's missing prefix along first, so the disk tier holds
whole prefixes and everything on it is reachable after a restart.

A block that is being moved is marked ``busy`` for the duration, so that the nested
evictions a move can trigger (device -> host -> disk) never pick the same block.

Each step that moves a block (evict, demote, write-back, retire, quarantine) has named fault
points at its start and its return (tierkv/core/faults.py), where the crash tests kill the process.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Collection, Sequence

from .blocks import Block, BlockTable
from ..errors import DiskWriteError, IndexWriteError
from .eviction import EvictionListeners
from .faults import fault_point
from ..identity import ChainMemo
from ..index import BlockRecord
from .priority import EPHEMERAL
from .stats import Counters
from ..tiers.base import TIER_KEY, TierName

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    import torch

    from ..config import StoreConfig
    from ..index import Index
    from ..tiers import DiskTier, MemoryTier

log = logging.getLogger(__name__)
DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK


class Placement:
    """The block table and the tiers and index its locations point into, under one lock."""

    def __init__(self, config: "StoreConfig", index: "Index", device: "MemoryTier", host: "MemoryTier",
                 disk: "DiskTier") -> None:
        self.config = config
        self.layout = config.layout
        self.index, self.device, self.host, self.disk = index, device, host, disk
        self.lock = threading.RLock()  # the table and the slot allocators (tierkv.core.store: what runs outside it)
        self.table = BlockTable(config.eviction_policy, {
            DEVICE: device.slots.capacity, HOST: host.slots.capacity, DISK: disk.capacity_slots,
        })
        self.eviction_listeners = EvictionListeners()
        self.stats_counters = Counters()
        # Retired (dead) blocks whose pages wait for their last lease or in-flight read.
        self._dead: list[Block] = []
        self.chain_memo = ChainMemo()  # key chains hashed here, for the lookups and puts that repeat them

    def tier(self, t: str) -> "MemoryTier":
        """The memory tier named ``t`` (a TierName, or its plain str: the keys of Block.loc)."""
        return self.device if t == DEVICE else self.host

    # ---- allocation with eviction -----------------------------------------------------
    def alloc_mem(self, t: TierName) -> int | None:
        """A free slot of memory tier ``t``, evicting as needed; None when every block there
        is leased, busy or has an extension in the tier."""
        slots = self.tier(t).slots
        alloc = slots.alloc
        slot = alloc()
        if slot is not None:
            return slot
        table = self.table
        evictions, tv = self.stats_counters.evictions, TIER_KEY[t]
        if self.drops_only(t):  # without evict()'s tests per victim
            drop, free = table.drop_victim, slots.free
            while slot is None:
                freed = drop(t)
                if freed is None:
                    return None
                evictions[tv] += 1
                free(freed)
                slot = alloc()
            return slot
        victim_of, evict = table.victim, self.evict
        while slot is None:
            victim = victim_of(t)
            if victim is None:
                return None
            evict(victim, t)
            slot = alloc()
        return slot

    def drops_only(self, t: TierName) -> bool:
        """Whether an eviction from memory tier ``t`` can only drop the block (no host tier
        to demote to, no disk tier, no listener: see :meth:`evict`)."""
        return (t != DISK and (t == HOST or not self.host.slots.capacity) and not self.disk.capacity_slots
                and not self.eviction_listeners)

    def place_new_dropping(self, blocks: list[Block], t: TierName) -> list[int]:
        """``alloc_mem`` + ``table.place`` for each new block, in one loop (where
        :meth:`drops_only`); returns the slots of the first blocks, those placed."""
        placed, evicted = self.table.place_dropping(blocks, t, self.tier(t).slots)
        self.stats_counters.evictions[TIER_KEY[t]] += evicted
        return placed

    def alloc_disk(self, model_version: str, keep: Sequence[Block] = ()) -> int | None:
        """A free disk slot for ``model_version``, never evicting the blocks in ``keep``;
        None when nothing can be evicted. Raises DiskWriteError when a new segment cannot be
        created (the tier is then degraded)."""
        loc = self.disk.alloc(model_version)
        if loc is not None:
            return loc  # the common case: no eviction, so nothing to protect
        with self.held(keep):
            while loc is None:
                victim = self.table.victim(DISK)
                if victim is None:
                    return None
                self.evict(victim, DISK)
                loc = self.disk.alloc(model_version)
            return loc

    def _ancestors(self, b: Block) -> list[Block]:
        """The cached prefix of ``b``, nearest first."""
        out: list[Block] = []
        p = self.table.get(b.parent)
        while p is not None:
            out.append(p)
            p = self.table.get(p.parent)
        return out

    def evict(self, b: Block, t: TierName) -> None:
        """Take ``b`` out of tier ``t``: demote it to the host when it leaves the device, and
        write it back to disk when this was its last copy (ephemeral blocks are just dropped)."""
        fault_point("placement.evict:before")
        self.stats_counters.evictions[TIER_KEY[t]] += 1
        moves = (t == DISK or (t == DEVICE and HOST not in b.loc and self.host.slots.capacity)
                 or (DISK not in b.loc and self.disk.capacity_slots and not self.disk.degraded))
        if not moves:
            # No demotion, write-back or index delete can follow (each needs a condition
            # of ``moves``), so neither the hold nor the body below: as in a store with one
            # memory tier, where this is every eviction.
            if self.eviction_listeners and len(b.loc) == 1:
                self.eviction_listeners.notify(b, t.value, lambda: self._page_copy(b, t))
            # = self.free(b, t, evicted=True), written out: this runs once per eviction, and
            # t is a memory tier here (a disk eviction always "moves": its index delete).
            table = self.table
            self.tier(t).slots.free(table.unplace(b, t, True))
            if not b.loc:
                table.remove(b)
            fault_point("placement.evict:after")
            return
        with self.table.holds.held([b]):  # the nested evictions a move triggers never pick b
            if (t == DEVICE and HOST not in b.loc and self.host.slots.capacity
                    and (DISK not in b.loc or b.priority != EPHEMERAL)):
                self._demote(b, DEVICE, HOST)
            if (t != DISK and DISK not in b.loc and b.priority != EPHEMERAL and set(b.loc) == {t}
                    and self.disk.capacity_slots and not self.disk.degraded):
                # Write-back (write_through=False, or a put that could not reach disk):
                # the last memory copy goes to disk instead of being lost. Without a usable
                # disk tier there is nothing to write (and no ancestor walk to pay for).
                self.flush_to_disk(b)
            if t == DISK:
                # Index first, then the slot: a crash in between leaves an unreferenced slot,
                # which the next open reclaims.
                self.index.delete_blocks([b.key])
        if self.eviction_listeners and set(b.loc) == {t}:
            # Its last local copy is going: listeners (a cluster node) may keep it elsewhere.
            self.eviction_listeners.notify(b, t.value, lambda: self._page_copy(b, t))
        self.free(b, t, evicted=True)
        fault_point("placement.evict:after")

    def _page_copy(self, b: Block, t: TierName) -> "torch.Tensor":
        """A CPU copy of ``b``'s page in tier ``t`` (held: the lock)."""
        if t == DISK:
            return self.disk.read_page(b.loc[DISK]).cpu()
        return self.tier(t).page(b.loc[t]).detach().to("cpu", copy=True)

    def _demote(self, b: Block, src: TierName, dst: TierName) -> None:
        fault_point("placement.demote:before")
        slot = self.alloc_mem(dst)
        if slot is not None:  # else no room below: the eviction drops this copy
            self.tier(dst).write(slot, self.tier(src).page(b.loc[src]))
            self.table.place(b, dst, slot)
            self.stats_counters.demoted_bytes += self.layout.page_bytes
        fault_point("placement.demote:after")

    def flush_to_disk(self, b: Block, page: "torch.Tensor | None" = None) -> bool:
        """Write a block that is not on disk to disk and index it (write-back on eviction,
        pinning, close, or a put whose blocks no memory tier can take, then from ``page``).

        Its cached prefix goes first where it is missing, so the disk tier always holds
        whole prefixes: after a restart every block on disk is reachable. The disk I/O runs
        under the lock because the caller needs the result before it can go on. A failure
        leaves the blocks where they were; returns whether ``b`` is on disk."""
        if DISK in b.loc:
            return True
        ancestors = self._ancestors(b)
        for a in reversed(ancestors):
            if DISK in a.loc or a.priority == EPHEMERAL:  # ephemeral: never on disk
                continue
            if not self._write_back(a, None, ancestors):
                return False
        return self._write_back(b, page, ancestors)

    def _write_back(self, b: Block, page: "torch.Tensor | None", keep: list[Block]) -> bool:
        # One call for the fault points around the step, which returns from six places.
        fault_point("placement.write_back:before")
        done = self._copy_to_disk(b, page, keep)
        fault_point("placement.write_back:after")
        return done

    def _copy_to_disk(self, b: Block, page: "torch.Tensor | None", keep: list[Block]) -> bool:
        if DISK in b.loc:
            return True
        if not self.disk.capacity_slots or self.disk.degraded or (page is None and not b.loc):
            return False
        try:
            # Making room must not evict b nor its prefix.
            loc = self.alloc_disk(b.model_version, [*keep, b])
        except (DiskWriteError, IndexWriteError) as e:  # write-back is best effort
            log.warning("write-back of block %s found no room: %s", b.key.hex()[:12], e)
            return False
        if loc is None:
            return False
        if page is None:
            src = DEVICE if DEVICE in b.loc else HOST
            page = self.tier(src).page(b.loc[src])
        try:
            # Data, fsync, then the index commit: the record never points at unwritten bytes.
            record = self.record(b, loc)
            self.disk.write_pages([(loc, page.detach().cpu())], [record.slot_body()])
            self.index.put_blocks([record])
        except (DiskWriteError, IndexWriteError) as e:
            # Nothing points at the slot (the commit failed or never ran): give it back.
            log.warning("write-back of block %s failed: %s", b.key.hex()[:12], e)
            self.disk.free(loc)
            return False
        self.table.place(b, DISK, loc)
        self.stats_counters.demoted_bytes += self.layout.page_bytes
        return True

    # ---- freeing -------------------------------------------------------------------------
    def free(self, b: Block, t: TierName, evicted: bool = False) -> None:
        slot = self.table.unplace(b, t, evicted)
        if t == DISK:
            self.disk.free(slot)
        else:
            self.tier(t).slots.free(slot)
        if not b.loc:
            self.table.remove(b)

    def retire(self, b: Block, index_done: bool = False) -> int:
        """Make ``b`` unreachable now (index first, unless the caller already committed the
        delete); free its pages now, or when its last lease or in-flight read ends. Returns
        the bytes freed now."""
        fault_point("placement.retire:before")
        if DISK in b.loc and not index_done:
            self.index.delete_blocks([b.key])
        self.table.detach(b)
        freed = 0
        if b.leases or b.busy:
            if b not in self._dead:
                self._dead.append(b)
        else:
            freed = self._free_detached(b)
        fault_point("placement.retire:after")
        return freed

    def _free_detached(self, b: Block) -> int:
        freed = 0
        for t, slot in list(b.loc.items()):
            freed += self.disk.slot_bytes if t == DISK else self.tier(t).page_bytes  # as stored (page codec)
            if t == DISK:
                self.disk.free(slot)
            else:
                self.tier(t).slots.free(slot)
        b.loc.clear()
        return freed

    def held(self, blocks: Sequence[Block]) -> "AbstractContextManager[list[Block]]":
        """``with self.held(blocks):`` keeps them busy for the scope; blocks retired
        meanwhile are freed at its end if nothing else holds them."""
        return self.table.holds.held(blocks, self._free_if_unheld)

    def unhold(self, blocks: list[Block]) -> None:
        self.table.holds.unhold(blocks, self._free_if_unheld)

    def unbusy(self, b: Block) -> None:
        """End an in-flight read of ``b``; a retired block is freed now if nothing holds it."""
        if self.table.holds.unbusy(b):
            self._free_if_unheld(b)

    def _free_if_unheld(self, b: Block) -> None:
        if b.dead and not b.leases and not b.busy and b in self._dead:
            self._dead.remove(b)
            self._free_detached(b)

    def release_blocks(self, blocks: list[Block], ended: bool = True) -> None:
        """Drop one lease from each block; free retired blocks whose last lease this was;
        drop ephemeral blocks when their lease ends (``ended=False``: the lease was never
        handed out, as when acquire stops short, so ephemeral blocks stay)."""
        for b in self.table.holds.unlease_many(blocks):
            if b.dead:
                self._free_if_unheld(b)
            elif b.priority == EPHEMERAL and ended:
                self.retire(b)

    # ---- quarantine ----------------------------------------------------------------------
    def quarantine_key(self, key: bytes, reason: str) -> None:
        log.warning("quarantined block %s: %s", key.hex()[:16], reason)
        self.index.quarantine(key, reason)
        self.stats_counters.quarantined += 1

    def quarantine(self, b: Block, reason: str) -> bool:
        """Drop a block proven bad (failed checksum, wrong token ids). Returns False when the
        index could not record it: the block then stays where it is, and since every read
        checks it again it is never served; it is quarantined at a later read or open.
        Dropping it from memory only would free its disk slot while the index still points
        there, and a new page in that slot would be lost to the stale record at the next open."""
        fault_point("placement.quarantine:before")
        try:
            self.quarantine_key(b.key, reason)  # records the reason and deletes the entry in one commit
        except IndexWriteError as e:
            self.stats_counters.quarantine_failed += 1
            log.error("could not quarantine block %s (%s): %s", b.key.hex()[:16], reason, e)
            fault_point("placement.quarantine:after")
            return False
        self.retire(b, index_done=True)
        fault_point("placement.quarantine:after")
        return True

    def record(self, b: Block, disk_loc: int) -> BlockRecord:
        return BlockRecord(
            key=b.key, parent=b.parent, model_version=b.model_version, namespace=b.namespace,
            priority=int(b.priority), checksum=b.checksum, disk_loc=disk_loc, last_access=time.time(), tokens=b.tokens,
        )

    # ---- whole-state checks and closing ----------------------------------------------------
    def pending_frees(self) -> int:
        """Retired blocks whose pages wait for a lease or an in-flight read to end (held:
        the lock)."""
        return len(self._dead)

    def check_integrity(self, reserved: Collection[int] = ()) -> None:
        """Recompute every total from its source of truth (held: the lock): the table, each
        tier's allocator against the blocks placed in it (and the device slots ``reserved``
        by reads in flight: an acquire's, a warm start's), the disk against the index."""
        self.table.check_integrity()
        self.device.check_integrity()
        self.host.check_integrity()
        self.disk.check_integrity()
        for b in self._dead:
            assert b.dead and (b.leases or b.busy), f"retired block {b.key.hex()[:12]} is held by nothing"
        for t, tier in ((DEVICE, self.device), (HOST, self.host)):
            placed = {b.loc[t] for b in self.table.blocks.values() if t in b.loc}
            placed |= {b.loc[t] for b in self._dead if t in b.loc}
            if t == DEVICE:
                assert not placed & set(reserved), "a device slot both placed and reserved for a read"
                placed |= set(reserved)
            assert placed == tier.slots.used_slots(), f"{t.value}: slot owners disagree with the allocator"
        disk_blocks = {b.key: b.loc[DISK] for b in self.table.blocks.values() if DISK in b.loc}
        assert len(set(disk_blocks.values())) == len(disk_blocks), "two blocks share a disk slot"
        assert self.disk.num_used == len(disk_blocks) + sum(1 for b in self._dead if DISK in b.loc)
        indexed = {k: rec for k, rec in self.index.iter_blocks()}
        assert set(indexed) == set(disk_blocks), "index entries and disk-resident blocks differ"
        for k, rec in indexed.items():
            assert rec is not None and rec.disk_loc == disk_blocks[k], f"index location of {k.hex()[:12]} is stale"
        self.index.check_integrity()

    def close(self) -> None:
        """Close the tiers and the index (held: the lock); each is closed even when another
        fails (the shared memory must be unlinked, the LMDB environment released)."""
        for part in (self.device, self.host, self.disk, self.index):
            try:
                part.close()
            except Exception:  # noqa: BLE001 - the other parts still go
                log.exception("closing %s failed", type(part).__name__)
