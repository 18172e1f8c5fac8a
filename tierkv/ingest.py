"""Ingest: ``put``, the write path of the store, and its undo.

:class:`Ingest` is given the store's :class:`~tierkv.placement.Placement` (its lock, table,
tiers and index, and the allocation and write-back it does). The order that makes a put
crash-safe: claim the keys and disk slots under the lock; outside it, write the pages and
fsync them, then commit the index; only then enter the blocks in the table and return.
A crash before the commit leaves slots nothing points to, reclaimed at the next open.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from .blocks import Block
from .checksum import page_rows, row_checksums
from .errors import PageFormatError
from .identity import Scope, as_token_array, same_bytes
from .index import BlockRecord
from .placement import Placement
from .policy import HINT_CONTINUATION, HINT_FRESH, HINT_TAIL
from .priority import EPHEMERAL, PINNED, Priority
from .results import PutResult
from .tiers import TierName
from .tiers.base import TIER_KEY

log = logging.getLogger(__name__)
DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK
# A put's pages of at least this many bytes are checksummed beside their disk write.
OVERLAP_CHECKSUM_BYTES = 1 << 20


class _PagesByKey(Mapping[bytes, torch.Tensor]):
    """A put's pages by block key, indexed on access (most puts never need one page alone)."""

    def __init__(self, pages: torch.Tensor, rows: dict[bytes, int]) -> None:
        self._pages, self._rows = pages, rows

    def __getitem__(self, key: bytes) -> torch.Tensor:
        return self._pages[self._rows[key]]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)


class Ingest:
    """The write path: ``put`` and its undo."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        # The placement's parts, bound once (they never change): read on every put.
        self.config, self.layout, self.table = placement.config, placement.layout, placement.table
        self.disk, self.index, self.stats_counters = placement.disk, placement.index, placement.stats_counters
        self._lock = placement.lock
        self._io_lock = threading.Lock()  # serialises a put's disk writes (one fsync stream)
        self._writing: set[bytes] = set()  # keys a put has claimed and not yet entered or abandoned
        # While a large put's pages are written: hashes them (xxhash drops the GIL) and
        # copies them into the device slots the put reserved.
        self._helper = ThreadPoolExecutor(1, thread_name_prefix="tierkv-put-helper")

    def close(self) -> None:
        """Wait for the helper thread (after the last put has returned)."""
        self._helper.shutdown(wait=True)

    def check_integrity(self) -> None:
        """(held: the lock) A key is claimed by a put only while it is not in the table:
        the put enters its blocks and drops its claims in one hold of the lock."""
        claimed = self._writing & self.table.blocks.keys()
        assert not claimed, f"{len(claimed)} key(s) claimed by a put are already in the table"

    def put(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, pages: torch.Tensor, scope: Scope, *,
            start_block: int = 0, block_extra: Sequence[Sequence[str | bytes]] | None = None,
            priority: Priority = Priority.NORMAL) -> PutResult:
        """Store pages ``[n, L, 2, B, H, D]`` of blocks ``start_block .. start_block+n-1``.

        Blocks already stored (or being stored by another thread) are skipped. With
        write-through (the default) and for pinned blocks, the pages are on disk, fsynced and
        indexed when this returns (``durable=True``); ephemeral blocks stay in memory.
        Raises PageFormatError, InvalidTokensError, or DiskWriteError (the tier is then marked
        degraded; later puts keep to memory until it recovers).
        """
        arr = as_token_array(tokens)
        n_full = len(arr) // self.layout.block_size
        n = int(pages.shape[0]) if isinstance(pages, torch.Tensor) and pages.dim() > 0 else 0
        self.layout.check_pages(pages)
        if start_block < 0 or start_block + n > n_full:
            raise PageFormatError(
                f"{n} pages from block {start_block} exceed the {n_full} full blocks of {len(arr)} tokens"
            )
        bs = self.layout.block_size
        step = 4 * bs
        # A byte view of the tokens, not a copy (tierkv/placement.py, match): each new block
        # copies its own ids out of it.
        raw = arr.data.cast("B")
        # Keys this store computed before from these very token bytes (the lookup before
        # this put, an earlier request on the same prefix) are reused: tierkv.identity.
        # ChainMemo proves each by byte equality; only the rest is hashed.
        keys = self.placement.chain_memo.chain_keys(arr, scope.seed, bs, start_block + n, block_extra)
        durable_wanted = priority == PINNED or (self.config.write_through and priority != EPHEMERAL)
        new: list[Block] = []
        row_of: dict[bytes, int] = {}
        page_of = _PagesByKey(pages, row_of)  # a view per block only when one is needed
        disk_plan: list[tuple[int, Block]] = []
        reserved: list[int] = []  # device slots taken for ``new`` (in its order) before the write
        copying: Future[None] | None = None
        with self._lock:
            get = self.table.blocks.get  # = table.get, bound once: called for every block
            # The eviction policy's insertion class (tierkv/policy.py): did the request find
            # a cached prefix, and which block is the put's last.
            cont = HINT_CONTINUATION if start_block > 0 or (keys and keys[0] in self.table.blocks) else HINT_FRESH
            writing, mv, ns = self._writing, scope.model_version, scope.namespace  # bound once: read per block
            last = start_block + n - 1
            for i in range(start_block, start_block + n):
                key = keys[i]
                old = get(key)
                if old is not None:
                    if same_bytes(old.tokens, raw[i * step : (i + 1) * step]):
                        continue  # stored already
                    # A stored block under this key with other token ids (a corrupt record or
                    # a collision): it can never be served, so the new block replaces it.
                    self.stats_counters.token_mismatch += 1
                    if not self.placement.quarantine(old, "stored token ids differ from a put's"):
                        continue  # the index refused the quarantine: keep the old one, store nothing
                if key in writing:
                    continue  # another put is storing it
                writing.add(key)
                row_of[key] = i - start_block
                # The checksum is filled in below, before the block is indexed or entered in
                # the table (nothing sees it before then). Positional: Block's field order.
                ids = bytes(raw[i * step : (i + 1) * step])  # the block's own copy of its ids
                new.append(Block(key, keys[i - 1] if i else scope.seed, mv, ns, ids, 0, priority,
                                 hint=cont | HINT_TAIL if i == last else cont))
            # Making room on disk must not evict this request's own blocks; those cached only
            # in memory (put while the disk was degraded, or in write-back mode) go to disk
            # first, so that the disk tier holds whole prefixes.
            try:
                if durable_wanted and self.disk.capacity_slots and not self.disk.degraded:
                    cached = [blk for k in keys if (blk := get(k)) is not None]
                    for blk in cached:
                        if DISK not in blk.loc and blk.priority != EPHEMERAL:
                            self.placement.flush_to_disk(blk)
                    for b in new:
                        loc = self.placement.alloc_disk(b.model_version, cached)
                        if loc is None:
                            break  # disk full of pinned/leased blocks: the rest stays in memory
                        disk_plan.append((loc, b))
                # A whole batch bound for disk whose device slots are free now: the slots are
                # taken here and filled by a helper thread while the disk is written, so the
                # copy is off the put's path (it was an eighth of a large put's time). No
                # block points at them until the put enters its blocks; an abort frees them.
                if new and len(disk_plan) == len(new) and self.disk.codec.exact:
                    reserved = self.placement.device.reserve(len(new))
            except BaseException:
                self._abort_put(new, disk_plan)
                raise
        try:
            # With a page codec the checksum covers the stored (encoded) form (tierkv/codec.py).
            stored = self.disk.codec.to_stored(pages) if new else pages  # nothing to encode for a repeat
            # The pages as bytes, once: for the checksums, and (exact pages) the memory copy.
            stored_rows = page_rows(stored) if new else None
            # row_of: the new blocks' keys and page rows, in the order of ``new``. A large
            # batch bound for disk is hashed on a helper thread while its pages are written
            # (its slot records, which carry the checksums, are written after the pages);
            # a small one in line (a thread-pool job cost more than hashing a small page).
            sums: Future[list[int]] | None = None
            if stored_rows is not None:
                if disk_plan and stored_rows.nbytes >= OVERLAP_CHECKSUM_BYTES:
                    sums = self._helper.submit(row_checksums, list(row_of), stored_rows, list(row_of.values()))
                else:
                    for b, s in zip(new, row_checksums(list(row_of), stored_rows, list(row_of.values()))):
                        b.checksum = s
            # Slots in shared memory whose bytes are whole disk slots: the pages are written
            # to disk from them, each run copied in just before it is written, instead of
            # being copied once into the slots (a helper thread) and once more into staging.
            targets = self._direct_sources(reserved) if stored is pages else None
            if reserved and targets is None:
                copying = self._helper.submit(self.placement.device.write_many, reserved, pages,
                                              list(row_of.values()), stored_rows if stored is pages else None)
            if disk_plan:
                records: list[BlockRecord] = []

                def slot_bodies() -> list[bytes]:
                    """The slot records, once the checksums are known (after the pages)."""
                    if sums is not None:
                        for b, s in zip(new, sums.result()):
                            b.checksum = s
                    records.extend(self.placement.record(b, loc) for loc, b in disk_plan)
                    return [r.slot_body() for r in records]

                # Order matters: pages and their slot records written and fsynced, then the
                # index commit, then we ack. A slot record carries the checksum, so it waits.
                with self._io_lock:
                    if targets is not None:
                        rows = list(row_of.values())  # in the order of ``new``, as ``reserved`` and ``disk_plan``

                        def fill(positions: list[int]) -> None:
                            self.placement.device.write_many([reserved[p] for p in positions], pages,
                                                             [rows[p] for p in positions], stored_rows)

                        self.disk.write_slots([(loc, t) for (loc, _), t in zip(disk_plan, targets)], fill, slot_bodies)
                    else:
                        self.disk.write_pages([(loc, stored[row_of[b.key]].detach().cpu()) for loc, b in disk_plan],
                                              slot_bodies)
                    self.index.put_blocks(records)
        except BaseException:
            if copying is not None:
                wait([copying])  # nothing may write a reserved slot once it is freed
            with self._lock:
                self._abort_put(new, disk_plan, reserved)
            raise
        if copying is not None and copying.exception() is not None:
            # The pages are durable; only their copy in memory failed: placed as usual.
            log.error("copying a put's pages into the device tier failed: %s", copying.exception())
            with self._lock:
                self._abort_put([], [], reserved)
            reserved = []
        with self._lock:
            self._place_new(keys, new, disk_plan, page_of, pages, row_of, stored_rows if stored is pages else None,
                            reserved)
            self.stats_counters.puts += 1
            self.stats_counters.blocks_stored += len(new)
            get = self.table.blocks.get
            # Without a disk tier nothing is durable: no walk of the chain to find that out.
            all_durable = not n or (self.disk.capacity_slots > 0 and all(
                (blk := get(k)) is not None and TIER_KEY[DISK] in blk.loc for k in keys[start_block:]))
        return PutResult(stored=len(new), skipped=n - len(new), durable=all_durable)

    def _direct_sources(self, reserved: list[int]) -> list[memoryview] | None:
        """The reserved device slots' bytes, when each is one whole disk slot the disk tier
        may write from (shared memory, 4 KiB-aligned, a page of a 4 KiB multiple), else None."""
        if not reserved or self.disk.slot_bytes != self.layout.page_bytes:
            return None
        targets = [self.placement.device.direct_target(slot) for slot in reserved]
        return None if any(t is None for t in targets) else targets  # type: ignore[return-value]

    def _abort_put(self, new: list[Block], disk_plan: list[tuple[int, Block]], reserved: Sequence[int] = ()) -> None:
        """Undo a failed put (held: the lock): its disk slots, its reserved device slots (no
        copy into them may be running) and its claim on the keys."""
        for loc, _ in disk_plan:
            self.disk.free(loc)
        for slot in reserved:
            self.placement.device.slots.free(slot)
        self._writing.difference_update(b.key for b in new)

    def _unplace_new(self, new: list[Block]) -> None:
        """Undo the memory part of a put that failed while placing (held: the lock): its
        blocks that are not durable leave every tier and the table, so the put leaves
        nothing behind (no block without pages, no slot). Blocks already on disk stay: they
        are indexed and complete, and undoing them would need an index write, which may be
        what just failed."""
        for b in new:
            if DISK in b.loc or self.table.get(b.key) is not b:
                continue
            for t in b.tiers:
                self.placement.free(b, t)
            if self.table.get(b.key) is b:
                self.table.remove(b)

    def _place_new(self, keys: list[bytes], new: list[Block], disk_plan: list[tuple[int, Block]],
                   page_of: Mapping[bytes, torch.Tensor], pages: torch.Tensor, row_of: dict[bytes, int],
                   page_bytes: np.ndarray | None, reserved: list[int]) -> None:
        """Enter a put's blocks in the table and copy them into memory (held: the lock).
        ``page_bytes``: ``page_rows(pages)``, when the put made it for its checksums;
        ``reserved``: device slots already holding the pages of ``new`` (in its order).

        The request's whole chain is held busy meanwhile, so that making room evicts other
        blocks, never this prefix; once the device tier has no room left, the rest of the
        blocks go to the host tier, so a prefix never sits below its own extensions."""
        for loc, b in disk_plan:
            self.table.add(b)
            self.table.place(b, DISK, loc)
        get = self.table.blocks.get  # = table.get, bound once: called for every block
        self.table.add_new(new)
        chain = [blk for blk in map(get, keys) if blk is not None]
        try:
            self.table.hold(chain)  # = placement.held(chain), without a context manager per put
            try:
                if reserved:
                    place = self.table.place
                    for b, slot in zip(new, reserved):
                        place(b, DEVICE, slot)
                elif not disk_plan and self.placement.drops_only(DEVICE):
                    # One memory tier, nothing below it: place and evict in one loop.
                    placed = self.placement.place_new_dropping(new, DEVICE)
                    self.placement.device.write_many(placed, pages, list(row_of.values())[: len(placed)], page_bytes)
                    for b in new[len(placed):]:  # every block there is leased or held
                        self.stats_counters.admissions_refused += 1
                        self.table.remove(b)
                else:
                    self._place_general(new, pages, row_of, page_of)
            finally:
                self.placement.unhold(chain)
        except BaseException:
            self._unplace_new(new)
            raise
        finally:
            self._writing.difference_update(row_of)  # the keys of ``new``
        self.table.touch_chain([blk for blk in chain if get(blk.key) is blk], hit=False)

    def _place_general(self, new: list[Block], pages: torch.Tensor, row_of: dict[bytes, int],
                       page_of: Mapping[bytes, torch.Tensor]) -> None:
        """Copy a put's new blocks into the device tier, then the host tier once the device
        has no room, writing back to disk what neither can take (held: the lock and the
        chain)."""
        tiers = [DEVICE, HOST]
        # Pages are copied in one batch per tier at the end: the slots are placed
        # first, but every block of this put is held, so nothing moves or reads them
        # before the copy (and the lock is held throughout).
        pending: dict[TierName, tuple[list[int], list[int]]] = {DEVICE: ([], []), HOST: ([], [])}

        def copy_pending() -> None:
            for t, (slots, rows) in pending.items():
                self.placement.tier(t).write_many(slots, pages, rows)
                slots.clear()
                rows.clear()

        alloc_mem, place = self.placement.alloc_mem, self.table.place
        for b in new:
            while tiers:
                slot = alloc_mem(tiers[0])
                if slot is not None:
                    slots, rows = pending[tiers[0]]
                    slots.append(slot)
                    rows.append(row_of[b.key])
                    place(b, tiers[0], slot)
                    break
                tiers.pop(0)
            if not b.loc and b.priority != EPHEMERAL:
                copy_pending()  # write-back may read this put's earlier pages from memory
                self.placement.flush_to_disk(b, page_of[b.key])  # write-back: memory is full
            if not b.loc:
                self.stats_counters.admissions_refused += 1
                self.table.remove(b)  # nowhere to keep it: the put stored nothing for it
        copy_pending()
