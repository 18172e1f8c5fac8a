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
a :class:`~tierkv.results.Lease` whose pool is that buffer. A block read through a second
time is promoted as usual: a prefix used again is worth its place in memory (the same
"seen once" rule as the eviction policy's recent list).

Ownership: the blocks of the window are leased under the store lock before any read, so
nothing evicts or frees their disk slots meanwhile (as for a promotion); a block that fails
its read ends the lease there (quarantined when its page is proven bad, a miss otherwise,
:class:`~tierkv.promotion.Promotion` classifies and settles it). The buffer belongs to the
lease until its release, then returns to :class:`ReadThrough`, which keeps at most
``KEEP_BUFFERS``.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING

from .blocks import Block
from .placement import Placement
from .promotion import PlannedRead, Promotion
from .results import Lease
from .tiers import TierName
from .tiers.base import TIER_KEY
from .tiers.diskio import BounceBuffer

if TYPE_CHECKING:
    from .store import Store

DISK_KEY, DEVICE_KEY, HOST_KEY = TIER_KEY[TierName.DISK], TIER_KEY[TierName.DEVICE], TIER_KEY[TierName.HOST]
# Buffers kept for reuse: a restore holds one window being copied and LeaseWindows reads up
# to three ahead (tierkv/hf/prefill.py).
KEEP_BUFFERS = 4
# Blocks remembered as read through once; the oldest are forgotten beyond this (their next
# read is read through again, which costs nothing but the chance to promote).
SEEN_LIMIT = 1 << 16


class ReadThrough:
    """Reads of cold windows into lease-owned buffers (see the module docstring)."""

    def __init__(self, store: "Store", placement: Placement, promotion: Promotion) -> None:
        self.store, self.placement, self.promotion = store, placement, promotion
        self.layout, self.disk = placement.layout, placement.disk
        self._seen: OrderedDict[bytes, None] = OrderedDict()  # held: the store lock
        self._buffers: list[BounceBuffer] = []  # free buffers, largest last
        self._buffers_lock = threading.Lock()
        self._lent = 0  # buffers held by leases (for check_integrity)
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
        with self._buffers_lock:
            self._lent += 1
            for i, buf in enumerate(self._buffers):
                if buf.nbytes >= nbytes:
                    return self._buffers.pop(i)
        # Aligned for O_DIRECT; faulted in by the reads themselves, on the disk tier's reader
        # threads (READ_DEPTH of them), not here, serially, ahead of the first read.
        return BounceBuffer(nbytes, populate=False)

    def _give(self, buf: BounceBuffer) -> None:
        with self._buffers_lock:
            self._lent -= 1
            self._buffers.append(buf)
            self._buffers.sort(key=lambda b: b.nbytes)
            while len(self._buffers) > KEEP_BUFFERS:
                self._buffers.pop(0).close()  # the smallest goes

    def check_integrity(self) -> None:
        """(held: the lock) Bounded memory: at most KEEP_BUFFERS free buffers and SEEN_LIMIT
        remembered blocks; never more buffers returned than lent."""
        with self._buffers_lock:
            assert len(self._buffers) <= KEEP_BUFFERS, f"{len(self._buffers)} free read-through buffers"
            assert self._lent >= 0, f"read-through buffers returned more often than lent ({self._lent})"
        assert len(self._seen) <= SEEN_LIMIT, f"{len(self._seen)} blocks remembered as read through"

    def close(self) -> None:
        """Unmap the free buffers (those of leases still held go when the leases do)."""
        with self._buffers_lock:
            for buf in self._buffers:
                buf.close()
            self._buffers.clear()

