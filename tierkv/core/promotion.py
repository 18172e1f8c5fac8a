"""Promotion: copying leased blocks' pages up into the device tier, and settling each one.

:class:`Promotion` is given the store's :class:`~tierkv.core.placement.Placement`. ``acquire``
plans under the store lock one :class:`PlannedRead` per block to bring up
(:meth:`Promotion.plan_read`): the block is leased and busy (nothing moves or frees it), a
device slot is reserved, and an event (:meth:`Promotion.read_of`) lets another acquire of the
same block wait for this read instead of doing it twice. :meth:`Promotion.promote` then
reads and verifies outside the lock, and settles every planned block in a ``finally``, one
at a time, each in its own ``try``/``finally``:
the slot is placed or freed, the busy count dropped and the event set, whatever else fails
(an index that refuses to record a quarantine, an interrupt). Waiters wait at most
``PROMOTION_WAIT_S``; then that block is a miss for them, counted in ``wait_timeouts``.

What a failed read proves (docs/operations.md, "What we survive"):

- a checksum mismatch, or a segment file that provably lacks the slot (gone, or truncated
  short of it): the page is bad. Quarantined (index first), a counted miss.
- any other ``OSError`` (EIO from the device, a file system unmounted underneath): nothing
  about the page. The read is a miss, the block stays indexed and in the table, and the disk
  tier is *read-degraded* (stats ``tiers.disk.read_degraded``/``read_errors``, logged) until a
  read succeeds again. The next acquire of the block is the retry.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch

from .blocks import Block
from ..checksum import page_checksum
from .placement import Placement
from ..tiers import TierName

log = logging.getLogger(__name__)
DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK
# The longest an acquire waits for another thread's read of a block it needs. Reads of a
# run are a few milliseconds even on a busy NVMe; a minute means the reader is stuck.
PROMOTION_WAIT_S = 60.0


class ReadOutcome(Enum):
    PENDING = "not read"  # interrupted before its read ran: freed, nothing proven
    OK = "ok"
    BAD = "bad page"  # proven: quarantined
    IO_ERROR = "read error"  # unproven: a miss, the block stays


# The most staging a promotion of pages that cannot be read into their slots holds at once
# (a prefix of 1 GiB is read through a 64 MiB buffer, not a 1 GiB one faulted in per read).
STAGED_BYTES = 64 << 20


@dataclass(eq=False)
class PlannedRead:
    """One block of an acquire to bring into the device tier (``pos`` in the chain)."""

    pos: int
    block: Block
    slot: int  # the reserved device slot
    src: TierName
    outcome: ReadOutcome = ReadOutcome.PENDING
    detail: str = ""
    error: OSError | None = None


class Promotion:
    """Reads into the device tier for ``acquire``: planned under the lock, read outside it."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        # The placement's parts, bound once (they never change).
        self.layout, self.table, self.stats_counters = placement.layout, placement.table, placement.stats_counters
        self.device, self.host, self.disk = placement.device, placement.host, placement.disk
        self._lock = placement.lock
        # Reads in flight, by block key: (the event set when the read is settled, the device
        # slot it fills), dropped when settled.
        self._promoting: dict[bytes, tuple[threading.Event, int]] = {}
        # Verifies promoted pages while the next run is read (xxhash releases the GIL).
        self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-verify")

    def read_of(self, key: bytes) -> threading.Event | None:
        """The event of a read of ``key`` in flight, set when it is settled (held: the lock)."""
        entry = self._promoting.get(key)
        return None if entry is None else entry[0]

    def reads_in_flight(self) -> int:
        """Planned reads not yet settled (held: the lock)."""
        return len(self._promoting)

    def reserved_slots(self) -> set[int]:
        """Device slots reserved by planned reads not yet settled (held: the lock): used in
        the allocator, placed by no block yet (the placement's check counts them)."""
        return {slot for _, slot in self._promoting.values()}

    def check_integrity(self) -> None:
        """(held: the lock) No read listed as in flight is settled: settling sets the event
        and drops it from the list in one hold of the lock."""
        for key, (ev, _) in self._promoting.items():
            assert not ev.is_set(), f"read of {key.hex()[:12]} settled but still listed"
        assert len(self.reserved_slots()) == len(self._promoting), "two reads reserved one device slot"

    def close(self) -> None:
        """Wait for the verifying thread (after the last acquire has returned)."""
        self._checksummer.shutdown(wait=True)

    def plan_read(self, pos: int, b: Block, slot: int) -> PlannedRead:
        """Reserve ``b``'s promotion into device ``slot`` (held: the lock; ``b`` is leased)."""
        self.table.holds.busy(b)
        self._promoting[b.key] = (threading.Event(), slot)
        return PlannedRead(pos, b, slot, HOST if HOST in b.loc else DISK)

    def promote(self, plan: list[PlannedRead]) -> int | None:
        """Read and verify the planned pages into their device slots, outside the lock.
        Returns the chain position of the first block that is not promoted, or None. Every
        planned block is settled and its waiters woken, also when this raises."""
        try:
            direct: list[tuple[PlannedRead, memoryview]] = []
            to_cuda: list[tuple[PlannedRead, torch.Tensor]] = []  # kvikio: disk to CUDA slots
            host_to_cuda: list[PlannedRead] = []
            staged: list[PlannedRead] = []  # stored pages of a codec: decoded on the way in
            kvikio = self.disk.reads_to_device and self.device.device.type == "cuda"
            for r in plan:
                target = self.device.direct_target(r.slot) if r.src == DISK else None
                if target is not None and len(target) == self.layout.slot_bytes:
                    direct.append((r, target))
                elif r.src == DISK and kvikio:
                    to_cuda.append((r, self.device.page(r.slot)))
                elif r.src == DISK and (not self.disk.codec.exact or self.device.device.type == "cuda"):
                    staged.append(r)  # a codec's pages, or CUDA slots without kvikio
                elif r.src == HOST and self.device.device.type == "cuda":
                    host_to_cuda.append(r)
                else:
                    self._read_one(r)
            if host_to_cuda:
                self._copy_to_cuda(host_to_cuda)
            if direct:
                self._read_direct(direct, lambda r: self.device.page(r.slot))
            if to_cuda:
                self._read_direct(to_cuda, lambda r: self.device.page(r.slot), to_device=True)
            per = max(1, STAGED_BYTES // self.disk.slot_bytes)
            for i in range(0, len(staged), per):  # a bounded staging buffer, reused
                self._read_staged(staged[i : i + per])
        finally:
            first_failed = self.settle(plan)
        return first_failed

    def _copy_to_cuda(self, reads: list[PlannedRead]) -> None:
        """Host pages into CUDA slots: every copy queued at once (from page-locked memory they
        are asynchronous; one blocking copy per page left the link idle two thirds of the
        time: scripts/bench_gpu_io.py), then one wait for them all. Each source stays put
        meanwhile: its block is busy for the promotion, so its host slot is not reused."""
        try:
            for r in reads:
                self.device.write(r.slot, self.host.page(r.block.loc[HOST]), non_blocking=True)
        finally:
            torch.cuda.synchronize(self.device.device)
        for r in reads:
            r.outcome = ReadOutcome.OK

    def _read_one(self, r: PlannedRead) -> None:
        b = r.block
        try:
            if r.src == HOST:
                self.device.write(r.slot, self.host.page(b.loc[HOST]))
                r.outcome = ReadOutcome.OK
                return
            page = self.disk.read_page(b.loc[DISK])
            good = page_checksum(b.key, page) == b.checksum
            if good:
                self.device.write(r.slot, page)
        except OSError as e:
            self._read_failed(r, e)
            return
        if good:
            r.outcome = ReadOutcome.OK
        else:
            r.outcome, r.detail = ReadOutcome.BAD, "page checksum mismatch on read"

    def _read_failed(self, r: PlannedRead, e: OSError) -> None:
        """Classify a failed read: proof of a bad page only if the slot is provably gone."""
        if r.src == DISK and self.disk.page_missing(r.block.loc[DISK]):
            r.outcome, r.detail = ReadOutcome.BAD, f"page missing (segment gone or truncated): {e}"
        else:
            r.outcome, r.detail, r.error = ReadOutcome.IO_ERROR, str(e), e

    def read_into_buffer(self, plan: list[PlannedRead], targets: list[memoryview], pages: torch.Tensor) -> int | None:
        """Read-through (tierkv/core/read_through.py): the planned disk pages into ``targets``
        (whole slots of a buffer; ``pages[r.slot]`` is the page part of ``targets[r.slot]``),
        each verified there. Nothing is placed: each failure is noted as a promotion's is
        (a bad page quarantined, an I/O error a miss). Returns the chain position of the
        first block not read, or None."""
        self._read_direct(list(zip(plan, targets)), lambda r: pages[r.slot])
        first_failed: int | None = None
        with self._lock:
            for r in plan:
                if r.outcome is ReadOutcome.OK:
                    self.disk.note_read_ok()
                    continue
                self._note_failure(r)
                first_failed = r.pos if first_failed is None else min(first_failed, r.pos)
        return first_failed

    def _read_direct(self, reads: list[tuple[PlannedRead, Any]], page_of: Callable[[PlannedRead], torch.Tensor],
                     to_device: bool = False) -> None:
        """Disk pages straight into their targets (device slots in shared memory, or a
        read-through buffer: whole-slot memoryviews; with ``to_device``, CUDA pages read by
        kvikio), consecutive slots in one request, each then verified in place (``page_of``:
        the page a read landed in; a CUDA page through a host copy): a bad page is never
        visible, since its slot is placed (or its lease handed out) only after the check."""
        unread: set[int] = set()
        sums: dict[int, Future[int]] = {}
        read_many = self.disk.read_many_to_device if to_device else self.disk.read_many

        def verify_run(positions: list[int]) -> None:
            for p in positions:  # checksummed by a helper thread while the next run is read
                r = reads[p][0]
                sums[p] = self._checksummer.submit(page_checksum, r.block.key, page_of(r))

        try:
            read_many([(r.block.loc[DISK], target) for r, target in reads], verify_run)
        except OSError:
            for f in sums.values():
                f.cancel()
            sums.clear()
            # One by one, so that a failed read fails only its own page.
            for p, (r, target) in enumerate(reads):
                try:
                    if to_device:
                        self.disk.read_many_to_device([(r.block.loc[DISK], target)])
                    else:
                        self.disk.read_into(r.block.loc[DISK], target)
                except OSError as e:
                    self._read_failed(r, e)
                    unread.add(p)
        for p, (r, _) in enumerate(reads):
            if p in unread:
                continue
            got = sums[p].result() if p in sums else page_checksum(r.block.key, page_of(r))
            if got == r.block.checksum:
                r.outcome = ReadOutcome.OK
            else:
                r.outcome, r.detail = ReadOutcome.BAD, "page checksum mismatch on read"

    def _read_staged(self, reads: list[PlannedRead]) -> None:
        """Disk pages in a codec's stored form (tierkv/codec.py), or exact pages for CUDA
        slots when kvikio is absent: consecutive slots read in one request into the disk
        tier's staging buffer, each verified there (the checksum covers the stored bytes)
        and decoded or copied into its device slot by a helper thread while the next run is
        read (one blocking read and copy per page reached 0.69x dd into an H200's pool). The
        slot is placed only after this returns (settle), so a page is never visible before
        its check."""
        staging, views = self.disk.staging(len(reads))
        page_bytes = self.disk.page_bytes
        exact = self.disk.codec.exact
        unread: set[int] = set()
        sums: dict[int, Future[bool]] = {}

        def check_and_decode(p: int) -> bool:
            r = reads[p]
            page = staging[p, :page_bytes]
            if page_checksum(r.block.key, page) != r.block.checksum:
                return False
            self.device.write(r.slot, page.view(self.layout.torch_dtype).view(self.layout.shape) if exact else page)
            return True

        def verify_run(positions: list[int]) -> None:
            for p in positions:
                sums[p] = self._checksummer.submit(check_and_decode, p)

        try:
            self.disk.read_many([(r.block.loc[DISK], views[p]) for p, r in enumerate(reads)], verify_run)
        except OSError:
            for f in sums.values():
                f.cancel()
            for f in sums.values():  # none may still be writing a slot when its page is re-read
                if not f.cancelled():
                    f.exception()
            sums.clear()
            for p, r in enumerate(reads):  # one by one: a failed read fails only its own page
                try:
                    self.disk.read_into(r.block.loc[DISK], views[p])
                except OSError as e:
                    self._read_failed(r, e)
                    unread.add(p)
        for p, r in enumerate(reads):
            if p in unread:
                continue
            if sums[p].result() if p in sums else check_and_decode(p):
                r.outcome = ReadOutcome.OK
            else:
                r.outcome, r.detail = ReadOutcome.BAD, "page checksum mismatch on read"

    def settle(self, plan: list[PlannedRead]) -> int | None:
        """Place or free each planned slot, drop each busy count, wake each waiter. An error
        settling one block skips nothing: it is raised after all are settled."""
        first_failed: int | None = None
        error: BaseException | None = None
        with self._lock:
            for r in plan:
                ok = False
                try:
                    ok = self._settle_one(r)
                except BaseException as e:  # noqa: BLE001 - re-raised below, after the rest
                    log.exception("settling the promotion of block %s failed", r.block.key.hex()[:16])
                    error = error or e
                finally:
                    self.placement.unbusy(r.block)
                    entry = self._promoting.pop(r.block.key, None)
                    if entry is not None:
                        entry[0].set()
                if not ok:
                    first_failed = r.pos if first_failed is None else min(first_failed, r.pos)
        if error is not None:
            raise error
        return first_failed

    def _settle_one(self, r: PlannedRead) -> bool:
        """(held: the lock) Whether ``r.block`` is now in the device tier. The slot is
        placed or freed first, so nothing after it can leak it."""
        b = r.block
        if r.outcome is ReadOutcome.OK and r.src == DISK:
            self.disk.note_read_ok()
        if r.outcome is ReadOutcome.OK and not b.dead:
            self.table.place(b, DEVICE, r.slot)
            self.stats_counters.promoted_bytes += self.layout.page_bytes
            return True
        self.device.slots.free(r.slot)
        self._note_failure(r)
        return False

    def _note_failure(self, r: PlannedRead) -> None:
        """(held: the lock) What a read that did not succeed proves: a bad page is
        quarantined; an I/O error is a miss and the disk tier is read-degraded."""
        b = r.block
        if r.outcome is ReadOutcome.BAD and not b.dead:
            self.placement.quarantine(b, f"read failed: {r.detail}")
        elif r.outcome is ReadOutcome.IO_ERROR:
            self.disk.note_read_error(r.error or OSError(r.detail))
            log.warning("read of block %s failed (%s): a miss; the block stays stored", b.key.hex()[:16], r.detail)

    def await_reads(self, waits: list[tuple[int, threading.Event]], chain: list[Block],
                     failed: int | None) -> int | None:
        """Wait (bounded) for other threads' reads of blocks in ``chain``; returns the first
        position that is not in the device tier (or ``failed`` if earlier)."""
        deadline = time.monotonic() + PROMOTION_WAIT_S
        for i, ev in waits:
            if not ev.wait(max(0.0, deadline - time.monotonic())):
                with self._lock:
                    self.stats_counters.wait_timeouts += 1
                log.error("gave up waiting %.0f s for another read of block %s: a miss",
                          PROMOTION_WAIT_S, chain[i].key.hex()[:16])
            elif DEVICE in chain[i].loc and not chain[i].dead:
                continue
            failed = i if failed is None else min(failed, i)
        return failed
