"""Warm start: after a restart, bring back into the device tier what it held before.

A restart (an engine upgraded or redeployed, a daemon restarted, a crash) leaves every page
on disk, and without this the first requests after it wait for their reads: a vLLM hit
after an engine restart cost 2.3-3.2x vLLM's own hit, most of it the 16 MiB read (issue
#31). An engine or daemon takes seconds to start (weights, KV cache, warm-up), which is
time enough to read the hot pages back before anyone asks.

What is warm: at close (after the write-back) the store records the keys its device tier
holds, in the eviction order, first victim first (:func:`record`, index meta
:data:`WARM_META`). An open with ``StoreConfig.warm_at_open`` reads that record, deletes it
(a crash later must not bring back an older run's set), and :class:`WarmStart` promotes
those blocks back, on a thread of its own, least recent first, so that the tier's eviction
order comes back as it was. Without a record (the last run did not close: SIGKILL, power
loss; or a home written before this) the most recently written blocks (the index's
``last_access``) are warmed instead.

What it must not do: evict (only free device slots are used, and it stops at the first
block that does not fit), serve anything unverified (each page is read and checked by
:class:`~tierkv.core.promotion.Promotion` as an acquire's is: a bad page is quarantined, a
counted miss), or read a page twice (an acquire that needs a block being warmed waits for
that read: ``Promotion.read_of``). A record is a hint: keys no longer stored are skipped.
:meth:`WarmStart.stop` (the store's close) ends it between batches.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from ..errors import TierKVError
from ..tiers import TierName
from .promotion import PlannedRead, Promotion

if TYPE_CHECKING:
    from .blocks import Block
    from .placement import Placement

log = logging.getLogger(__name__)
DEVICE = TierName.DEVICE
DEVICE_KEY, HOST_KEY, DISK_KEY = DEVICE.value, TierName.HOST.value, TierName.DISK.value  # Block.loc's keys
WARM_META = "warm_set"  # index meta: the device tier's keys at the last close, hex, comma-separated
# The pages of one planned read: read as coalesced runs, like an acquire's, and small enough
# that close() waits for at most one batch (32 MiB: ~20 ms at 1.5 GB/s).
BATCH_BYTES = 32 << 20


def record(placement: Placement) -> int:
    """(held: the lock; at close, after the write-back) Record the device tier's keys that
    are on disk, first victim first; returns how many. A failure is logged, never raised:
    the record is a hint, and close must go on."""
    table = placement.table
    keys = [k for k in table.in_order(DEVICE) if DISK_KEY in table.blocks[k].loc]
    try:
        placement.index.put_meta(WARM_META, ",".join(k.hex() for k in keys))
    except TierKVError as e:
        log.warning("close: the warm-start record was not written (%s); the next open warms the newest blocks", e)
        return 0
    return len(keys)


def chain_order(blocks: list[Block]) -> list[Block]:
    """``blocks`` with each chain's blocks together, every parent before its children
    (depth first from the blocks whose parent is not among them, in their given order)."""
    among = {b.key: b for b in blocks}
    out: list[Block] = []
    seen: set[bytes] = set()
    for top in blocks:
        if top.parent in among or top.key in seen:
            continue
        stack = [top]
        while stack:
            b = stack.pop()
            if b.key in seen:
                continue
            seen.add(b.key)
            out.append(b)
            stack.extend(reversed([among[c] for c in b.children if c in among]))
    # Block.children is the table's bookkeeping; should a block not be linked under its
    # parent there, it still gets its slot, after the others.
    out.extend(b for b in blocks if b.key not in seen)
    return out


class WarmStart:
    """The background promotion of a warm start (module docstring); one per store, started
    at open when ``StoreConfig.warm_at_open`` is set."""

    def __init__(self, placement: Placement, promotion: Promotion) -> None:
        self.placement = placement
        self.promotion = promotion
        self.source = ""  # "record" (the last close's), "newest" (last_access) or "" (not started)
        self.asked = 0  # blocks chosen to warm
        self.warmed = 0  # ... now in the device tier by this warm start
        self.seconds = 0.0
        self.state = "off"  # off -> running -> done | stopped | failed
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start warming on a thread of its own (which takes the record: nothing here can
        fail the open)."""
        self.state = "running"
        self._thread = threading.Thread(target=self._run, name="tierkv-warm-start", daemon=True)
        self._thread.start()

    def _take_record(self) -> str | None:
        """The last close's record (None if there is none), deleted from the index."""
        index = self.placement.index
        raw = index.get_meta(WARM_META)
        if raw is not None:
            try:
                index.delete_meta(WARM_META)
            except TierKVError as e:  # a read-only index: the record stays, and is still right
                log.debug("warm start: the record could not be deleted: %s", e)
        return raw

    def _chosen(self) -> list[bytes]:
        """The keys to warm, least recent first, at most the device tier's free slots."""
        raw = self._take_record()
        slots = self.placement.device.slots
        room = slots.limit - slots.num_used  # what alloc() still hands out
        if room <= 0:
            return []
        if raw is not None:
            self.source = "record"
            keys = []
            for h in raw.split(",") if raw else ():
                try:
                    keys.append(bytes.fromhex(h))
                except ValueError:
                    log.warning("warm start: the record holds a malformed key; it is skipped")
            return keys[-room:]
        self.source = "newest"
        return self.placement.index.newest(room)

    def _run(self) -> None:
        t0 = time.perf_counter()
        try:
            keys = self._chosen()
            self.asked = len(keys)
            batch = max(1, BATCH_BYTES // self.placement.layout.page_bytes)
            for i in range(0, len(keys), batch):
                if self._stop.is_set():
                    self.state = "stopped"
                    break
                plan, full = self._plan(keys[i : i + batch])
                if plan:
                    self.promotion.promote(plan)  # settles every planned block; a failed read is a miss
                    warmed = sum(1 for r in plan if DEVICE_KEY in r.block.loc and not r.block.dead)
                    if warmed < len(plan):
                        log.debug("warm start: %d page(s) of a batch were not read", len(plan) - warmed)
                    self.warmed += warmed
                if full:
                    break
            if self.state == "running":
                self.state = "done"
        except Exception:  # a warm start is an optimisation: its failure is logged, never raised
            self.state = "failed"
            log.exception("warm start failed after %d block(s)", self.warmed)
        self.seconds = time.perf_counter() - t0
        log.info("warm start (%s): %d of %d block(s) brought into the device tier in %.3f s (%s)",
                 self.source, self.warmed, self.asked, self.seconds, self.state)

    def _plan(self, keys: list[bytes]) -> tuple[list[PlannedRead], bool]:
        """Under the lock: a read for each key stored below the device tier, into a free
        slot (nothing evicted); ``full`` when the free slots ran out.

        The reads keep the keys' order (the order the blocks enter the tier's eviction
        order), but the slots go to the blocks in chain order, so that a prompt's pages are
        one run of slots as an acquire would have placed them: the record lists a chain
        leaf first, and slots taken in that order put a 32-block prompt in 32 runs of one,
        which a vLLM load copies by an indexed copy (a daemon's first load after a restart,
        16 MiB: 9.0-10.5 ms against 7.1-7.6 as one run, 2026-12-07)."""
        placement, promotion = self.placement, self.promotion
        table, slots = placement.table, placement.device.slots
        with placement.lock:
            if self._stop.is_set():
                return [], False
            todo: list[tuple[int, Block]] = []
            for pos, key in enumerate(keys):
                b = table.get(key)
                if b is None or b.dead or DEVICE_KEY in b.loc or promotion.read_of(key) is not None:
                    continue
                if HOST_KEY not in b.loc and DISK_KEY not in b.loc:
                    continue
                todo.append((pos, b))
            taken: list[int] = []
            full = False
            for _ in todo:
                slot = slots.alloc()
                if slot is None:
                    full = True
                    break
                taken.append(slot)
            todo = todo[: len(taken)]
            slot_of = dict(zip((b.key for b in chain_order([b for _, b in todo])), sorted(taken)))
            plan = [promotion.plan_read(pos, b, slot_of[b.key]) for pos, b in todo]
        return plan, full

    def stop(self) -> None:
        """End the warm start (between batches) and wait for it: before the store closes."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until the warm start has ended; False when ``timeout`` passed first."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            return not thread.is_alive()
        return True

    def stats(self) -> dict[str, object]:
        return {"state": self.state, "source": self.source, "asked_blocks": self.asked,
                "warmed_blocks": self.warmed, "seconds": round(self.seconds, 4)}

    def check_integrity(self) -> None:
        assert 0 <= self.warmed <= self.asked, "warm start: more blocks warmed than chosen"
        assert self.state in ("off", "running", "done", "stopped", "failed"), f"warm start: state {self.state!r}"
