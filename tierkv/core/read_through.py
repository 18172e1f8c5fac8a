"""Read-through: a cold window of a prefix read from disk into a buffer of its own lease,
instead of being promoted into the device tier.

Why: a caller that copies the pages out and releases at once (a restore into transformers'
cache, :func:`tierkv.hf.restore_cache`) gains nothing from a device-tier copy of a prefix it
reads once, and the copy is not free: the first write to a fresh shared-memory page is a
page fault, and on the 2-vCPU VM of docs/performance.md the faults of the device slots
were a third of a cold restore's CPU time (perf: ``shmem_fault`` under the populator's
``madvise`` and O_DIRECT's ``get_user_pages``), against a plain file whose reader pays for
one destination buffer only. So ``acquire(..., promote=False)`` reads a window whose blocks
are all on disk only, read through for the first time since the store opened, into one
of a few reusable aligned buffers (faulted in by their first reads), verifies every page
there, and hands out
a :class:`~tierkv.lease.Lease` whose pool is that buffer. A block read through a second
time is promoted as usual: a prefix used again is worth its place in memory (the same
"seen once" rule as the eviction policy's recent list).

Ownership: the blocks of the window are leased under the store lock before any read, so
nothing evicts or frees their disk slots meanwhile (as for a promotion); a block that fails
its read ends the lease there (quarantined when its page is proven bad, a miss otherwise,
:class:`~tierkv.core.promotion.Promotion` classifies and settles it). The buffer belongs to the
lease until its release, then returns to the process's :class:`BufferPool`, which keeps at
most ``KEEP_BUFFERS`` for every store of the process: a store opened after another one
closed reads into memory already faulted in, as a plain file's reader reuses its heap
(fresh memory costs ~1 ms per MiB to fault in on the VM of docs/performance.md, half of a
4,096-token restore's CPU when each open made its own buffers). :func:`release_buffers`
gives them back to the system.
"""
from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from .blocks import Block
from .placement import Placement
from .promotion import PlannedRead, Promotion
from ..lease import Lease
from ..tiers import TierName
from ..tiers.base import TIER_KEY
from ..tiers.diskio import BounceBuffer

if TYPE_CHECKING:
    from .store import Store

DISK_KEY, DEVICE_KEY, HOST_KEY = TIER_KEY[TierName.DISK], TIER_KEY[TierName.DEVICE], TIER_KEY[TierName.HOST]
# Buffers kept for reuse: a restore holds one window being copied and LeaseWindows reads up
# to three ahead (tierkv/hf/prefill.py).
KEEP_BUFFERS = 4
# Blocks remembered as read through once; the oldest are forgotten beyond this (their next
# read is read through again, which costs nothing but the chance to promote).
SEEN_LIMIT = 1 << 16


class BufferPool:
    """Free read-through buffers, shared by the stores of this process (at most ``keep``,
    the largest kept). A buffer taken belongs to its taker until given back."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._free: list[BounceBuffer] = []  # smallest first

    def take(self, nbytes: int) -> BounceBuffer:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        # Aligned for O_DIRECT; faulted in by the reads themselves, on the disk tier's reader
        # threads (READ_DEPTH of them), not here, serially, ahead of the first read.
        return BounceBuffer(nbytes, populate=False)

    def give(self, buf: BounceBuffer) -> None:
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.nbytes)
            while len(self._free) > self.keep:
                self._free.pop(0).close()  # the smallest goes

    def holds(self, buf: BounceBuffer) -> bool:
        with self._lock:
            return any(b is buf for b in self._free)

    def __len__(self) -> int:
        with self._lock:
            return len(self._free)

    def clear(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for buf in free:
            buf.close()

    def _after_fork(self) -> None:
        # A child must not wait on a lock a thread of its parent held at the fork; its copies
        # of the buffers are its own (private mappings), so it may keep them.
        self._lock = threading.Lock()


POOL = BufferPool(KEEP_BUFFERS)
os.register_at_fork(after_in_child=POOL._after_fork)


def release_buffers() -> None:
    """Unmap the free read-through buffers of this process (those of leases still held go
    back to the pool at their release)."""
    POOL.clear()


class ReadThrough:
    """Reads of cold windows into lease-owned buffers (see the module docstring)."""

    def __init__(self, store: "Store", placement: Placement, promotion: Promotion) -> None:
        self.store, self.placement, self.promotion = store, placement, promotion
        self.layout, self.disk = placement.layout, placement.disk
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # held: the store lock
        self._lent_lock = threading.Lock()
        self._lent = 0  # this store's buffers held by leases (for check_integrity)
        # Pages land in the buffer as stored, so only an exact codec on a CPU store qualifies
        # (a CUDA store reads into its device slots, with kvikio where it can).
        self.enabled = placement.disk.codec.exact and placement.device.device.type == "cpu"

    def wants(self, chain: list[Block]) -> bool:
        """(held: the lock) Whether every block of ``chain`` is on disk only, read through
        never before, and not being promoted by another acquire."""
        if not self.enabled or not chain:
            return False
        for b in chain:
            loc = b.loc
            if (b.dead or DISK_KEY not in loc or DEVICE_KEY in loc or HOST_KEY in loc or b.key in self._seen
                    or self.promotion.read_of(b.key) is not None):
                return False
        return True

    def acquire(self, chain: list[Block], start_block: int, asked: int) -> Lease:
        """Lease ``chain`` (every block already leased by the caller, held: nothing) read
        through into a buffer. The lease ends before the first block that fails its read;
        the leases of that block and those after it are dropped here."""
        slot_bytes, page_bytes = self.disk.slot_bytes, self.layout.page_bytes
        buf = self._take(len(chain) * slot_bytes)
        n = len(chain)
        try:
            rows = buf.tensor[: n * slot_bytes].view(n, slot_bytes)
            pages = rows[:, :page_bytes].view(self.layout.torch_dtype).view(n, *self.layout.shape)
            plan = [PlannedRead(i, b, i, TierName.DISK) for i, b in enumerate(chain)]
            mm = memoryview(buf.mm)
            targets = [mm[i * slot_bytes : (i + 1) * slot_bytes] for i in range(n)]
            failed = self.promotion.read_into_buffer(plan, targets, pages)
        except BaseException:
            self._give(buf)
            with self.placement.lock:
                self.placement.release_blocks(chain, ended=False)
            raise
        ok = n if failed is None else failed
        with self.placement.lock:
            # A block invalidated meanwhile ends the lease too, as it ends a promotion.
            ok = next((i for i in range(ok) if chain[i].dead), ok)
            if ok < n:
                self.placement.release_blocks(chain[ok:], ended=False)
            self.placement.stats_counters.record_acquire([TierName.DISK.value] * ok, asked)
            self.placement.stats_counters.read_through_bytes += ok * page_bytes
            for b in chain[:ok]:
                self._seen[b.key] = None
            while len(self._seen) > SEEN_LIMIT:
                self._seen.popitem(last=False)
        if ok == 0:
            self._give(buf)
            return Lease(store=self.store, layout=self.layout, keys=(), slots=(), pool=pages[:0], blocks=[],
                         start_block=start_block)
        return Lease(store=self.store, layout=self.layout, keys=tuple([b.key for b in chain[:ok]]),
                     slots=tuple(range(ok)), pool=pages, blocks=chain[:ok], start_block=start_block,
                     read_through=buf)

    def released(self, lease: Lease) -> None:
        """Take back the buffer of a released read-through lease."""
        if lease.read_through is not None:
            buf, lease.read_through = lease.read_through, None
            lease.pool = lease.pool[:0]  # nothing can reach the buffer through the lease now
            self._give(buf)

    def _take(self, nbytes: int) -> BounceBuffer:
        with self._lent_lock:
            self._lent += 1
        return POOL.take(nbytes)

    def _give(self, buf: BounceBuffer) -> None:
        with self._lent_lock:
            self._lent -= 1
        POOL.give(buf)

    def check_integrity(self) -> None:
        """(held: the lock) Bounded memory: at most KEEP_BUFFERS free buffers in the process
        and SEEN_LIMIT remembered blocks; never more buffers returned than lent."""
        assert len(POOL) <= KEEP_BUFFERS, f"{len(POOL)} free read-through buffers"
        with self._lent_lock:
            assert self._lent >= 0, f"read-through buffers returned more often than lent ({self._lent})"
        assert len(self._seen) <= SEEN_LIMIT, f"{len(self._seen)} blocks remembered as read through"

    def close(self) -> None:
        """Forget what was read through. The free buffers stay in the process's pool for
        the next store (:func:`release_buffers` unmaps them)."""
        self._seen.clear()
