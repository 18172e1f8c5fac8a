"""The store: the embedded API over the three tiers, the block table and the durable index.

Concurrency: one lock (``self._lock``) guards the block table and the slot allocators. Page
I/O from disk (promotion in ``acquire``) and page writes in ``put`` happen *outside* it, on
blocks pinned by a lease or a ``busy`` count, so a slow disk read never stalls lookups of
blocks already in memory. Write-back from host to disk (only with ``write_through=False``)
is the exception: it runs under the lock because the slot it frees is needed right away.

Durability (see docs/format.md): a put writes pages into free disk slots, fsyncs, commits
the index, and only then returns. A delete commits the index first and frees slots after.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import numpy as np
import torch

from .blocks import Block, BlockTable, Priority
from .checksum import page_checksum
from .config import StoreConfig
from .errors import DiskWriteError, ForkedStoreError, LayoutMismatchError, LeaseError, NotFoundError
from .home import HomeLock
from .identity import Scope, as_token_array, iter_block_keys
from .index import NO_DISK, BlockRecord, Index
from .layout import PageLayout
from .operations import StoreOperations
from .results import Lease, LookupResult, PutResult
from .stats import Counters
from .tiers import DiskTier, MemoryTier, TierName
from .tiers.shm import default_shm_dir

log = logging.getLogger(__name__)
FORMAT_VERSION = "1"
DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK


class Store(StoreOperations):
    """A tierkv store opened in this process. Build with :func:`tierkv.open`.

    The data path (lookup, acquire, release, put, prefetch) and the placement machinery
    live here; operations (pin, invalidate, verify, stats, manifests) in
    :class:`~tierkv.operations.StoreOperations`."""

    def __init__(self, config: StoreConfig, socket_path: str | None = None) -> None:
        self.config = config
        self.layout: PageLayout = config.layout
        self._pid = os.getpid()
        self._lock = threading.RLock()
        self._io_lock = threading.Lock()  # serialises disk writes (one fsync stream)
        self._closed = False
        home = config.home
        self._home_lock = HomeLock(home, socket_path)
        try:
            self.index = Index(home / "index", config.index_map_bytes)
            self._check_layout()
            shm_dir = config.shm_dir or default_shm_dir()
            cuda = torch.cuda.is_available()
            self.device = MemoryTier(DEVICE, self.layout, config.device_bytes, config.resolved_device(), shm_dir)
            self.host = MemoryTier(HOST, self.layout, config.host_bytes, "cpu", shm_dir, pin=cuda)
            self.disk = DiskTier(
                home / "segments", self.layout, config.disk_bytes, config.segment_pages,
                odirect=config.odirect, fsync=config.fsync,
            )
            self.table = BlockTable()
            self.stats_counters = Counters()
            self._writing: set[bytes] = set()
            self._promoting: dict[bytes, threading.Event] = {}
            self._dead: list[Block] = []
            self._load_index()
            self._executor = ThreadPoolExecutor(max(1, config.prefetch_workers), thread_name_prefix="tierkv-prefetch")
        except BaseException:
            self._home_lock.release()
            raise
        log.info(
            "opened %s: device %s (%d slots), host %d slots, disk %d slots, read path %s",
            home, self.device.device, self.device.slots.capacity, self.host.slots.capacity,
            self.disk.capacity_slots, self.disk.read_path,
        )

    # ---- opening -------------------------------------------------------------------
    def _check_layout(self) -> None:
        stored = self.index.get_meta("layout")
        if stored is None:
            self.index.put_meta("layout", self.layout.to_json())
            self.index.put_meta("format_version", FORMAT_VERSION)
            return
        if stored != self.layout.to_json():
            raise LayoutMismatchError(f"{self.config.home} holds pages of layout {stored}, asked for {self.layout.to_json()}")

    def _load_index(self) -> None:
        """Rebuild the block table from the index: drop entries whose page is missing, short
        or (with verify_on_open='full') fails its checksum; reclaim unreferenced slots."""
        for key, rec in self.index.iter_blocks():
            if rec is None:
                self._quarantine_key(key, "undecodable index record")
                continue
            if rec.disk_loc == NO_DISK or not self.disk.claim(rec.disk_loc, rec.model_version):
                self._quarantine_key(key, "page missing or segment truncated")
                continue
            block = Block(
                key=key, parent=rec.parent, model_version=rec.model_version, namespace=rec.namespace,
                tokens=rec.tokens, checksum=rec.checksum, priority=Priority(rec.priority),
            )
            self.table.add(block)
            self.table.place(block, DISK, rec.disk_loc)
        self.table.rebuild_children()
        if self.config.verify_on_open == "full":
            self.verify(repair=True)
        self.disk.reclaim_empty()

    def _check_usable(self) -> None:
        if os.getpid() != self._pid:
            raise ForkedStoreError(f"this store was opened by pid {self._pid}, used from pid {os.getpid()}")
        if self._closed:
            raise NotFoundError("the store is closed", hint="open it again with tierkv.open()")

    # ---- lookup ----------------------------------------------------------------------
    def _match(self, arr: np.ndarray, scope: Scope, block_extra: Sequence[Sequence[str | bytes]] | None) -> list[Block]:
        """The longest chain of stored blocks for ``arr`` whose token ids equal the
        request's (held: the lock). A block whose stored ids differ is a collision or a
        corrupt record: quarantined, and the chain ends there."""
        bs = self.layout.block_size
        chain: list[Block] = []
        for i, key in enumerate(iter_block_keys(arr, scope.seed, bs, block_extra)):
            b = self.table.get(key)
            if b is None or b.dead:
                break
            if b.tokens != arr[i * bs : (i + 1) * bs].tobytes():
                self.stats_counters.token_mismatch += 1
                self._quarantine(b, "stored token ids differ from the request's")
                break
            chain.append(b)
        return chain

    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
               block_extra: Sequence[Sequence[str | bytes]] | None = None) -> LookupResult:
        """Longest cached prefix of ``tokens`` across all tiers, token ids verified."""
        self._check_usable()
        arr = as_token_array(tokens)
        t0 = time.perf_counter()
        with self._lock:
            chain = self._match(arr, scope, block_extra)
            self.table.touch_chain(chain)
            tiers = tuple(b.top_tier.value for b in chain)  # type: ignore[union-attr]
            self.stats_counters.record_lookup(len(arr) // self.layout.block_size, tiers, time.perf_counter() - t0)
        return LookupResult(len(chain) * self.layout.block_size, tuple(b.key for b in chain), tiers)

    # ---- allocation, eviction, demotion (held: the lock) ------------------------------
    def _tier(self, t: TierName) -> MemoryTier:
        return self.device if t == DEVICE else self.host

    def _alloc_mem(self, t: TierName) -> int | None:
        tier = self._tier(t)
        slot = tier.slots.alloc()
        while slot is None:
            victim = self.table.victim(t)
            if victim is None:
                return None
            self._evict(victim, t)
            slot = tier.slots.alloc()
        return slot

    def _alloc_disk(self, model_version: str) -> int | None:
        loc = self.disk.alloc(model_version)
        while loc is None:
            victim = self.table.victim(DISK)
            if victim is None:
                return None
            self._evict(victim, DISK)
            loc = self.disk.alloc(model_version)
        return loc

    def _evict(self, b: Block, t: TierName) -> None:
        """Take ``b`` out of tier ``t``, demoting it one tier down when nothing below holds it."""
        self.stats_counters.evictions[t.value] += 1
        if t == DEVICE and HOST not in b.loc and DISK not in b.loc and self.host.slots.capacity:
            self._demote(b, DEVICE, HOST)
        elif t == DEVICE and HOST not in b.loc and DISK in b.loc and self.host.slots.capacity and b.priority != Priority.EPHEMERAL:
            self._demote(b, DEVICE, HOST)
        elif t == HOST and DISK not in b.loc and b.priority != Priority.EPHEMERAL:
            self._flush_to_disk(b)
        if t == DISK:
            # Index first, then the slot: a crash in between leaves an unreferenced slot,
            # which the next open reclaims.
            self.index.delete_blocks([b.key])
        self._free(b, t)

    def _demote(self, b: Block, src: TierName, dst: TierName) -> None:
        slot = self._alloc_mem(dst)
        if slot is None:
            return
        self._tier(dst).write(slot, self._tier(src).page(b.loc[src]))
        self.table.place(b, dst, slot)
        self.stats_counters.demoted_bytes += self.layout.page_bytes

    def _free(self, b: Block, t: TierName) -> None:
        slot = self.table.unplace(b, t)
        if t == DISK:
            self.disk.free(slot)
        else:
            self._tier(t).slots.free(slot)
        if not b.loc:
            self.table.remove(b)

    def _retire(self, b: Block) -> int:
        """Make ``b`` unreachable now (index first); free its pages now, or when its last
        lease or in-flight read ends. Returns the bytes freed now."""
        if DISK in b.loc:
            self.index.delete_blocks([b.key])
        self.table.detach(b)
        if b.leases or b.busy:
            self._dead.append(b)
            return 0
        return self._free_detached(b)

    def _free_detached(self, b: Block) -> int:
        freed = 0
        for t, slot in list(b.loc.items()):
            freed += self.layout.slot_bytes if t == DISK else self.layout.page_bytes
            if t == DISK:
                self.disk.free(slot)
            else:
                self._tier(t).slots.free(slot)
        b.loc.clear()
        return freed

    def _quarantine_key(self, key: bytes, reason: str) -> None:
        log.warning("quarantined block %s: %s", key.hex()[:16], reason)
        self.index.quarantine(key, reason)
        self.stats_counters.quarantined += 1

    def _quarantine(self, b: Block, reason: str) -> None:
        self._quarantine_key(b.key, reason)
        self._retire(b)  # the index entry is already gone; _retire's delete is a no-op

    def _record(self, b: Block, disk_loc: int) -> BlockRecord:
        return BlockRecord(
            key=b.key, parent=b.parent, model_version=b.model_version, namespace=b.namespace,
            priority=int(b.priority), checksum=b.checksum, disk_loc=disk_loc, last_access=time.time(), tokens=b.tokens,
        )

    # ---- acquire / release -------------------------------------------------------------
    def acquire(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None) -> Lease:
        """Lease the longest cached prefix, promoted into the device tier.

        The lease covers fewer blocks than ``lookup`` finds when the device tier cannot hold
        them all (other leases) or a page fails verification (it is quarantined). Leased
        blocks are never evicted, moved or overwritten until :meth:`release`.
        """
        self._check_usable()
        arr = as_token_array(tokens)
        with self._lock:
            chain = self._match(arr, scope, block_extra)
            if max_blocks is not None:
                chain = chain[:max_blocks]
            self.table.touch_chain(chain)
            plan: list[tuple[int, Block, int, TierName]] = []
            waits: list[tuple[int, threading.Event]] = []
            # Lease block by block: blocks further along the chain are not leased yet, so
            # making room may evict them; the lease stops where the device tier is full.
            for i, b in enumerate(chain):
                b.leases += 1
                if DEVICE in b.loc:
                    continue
                if b.key in self._promoting:
                    waits.append((i, self._promoting[b.key]))
                    continue
                slot = self._alloc_mem(DEVICE)
                if slot is None or b.dead:
                    if slot is not None:
                        self.device.slots.free(slot)
                    self._release_blocks([b])
                    chain = chain[:i]
                    break
                src = HOST if HOST in b.loc else DISK
                b.busy += 1
                self._promoting[b.key] = threading.Event()
                plan.append((i, b, slot, src))
            self.stats_counters.record_acquire(tuple(b.top_tier.value for b in chain))  # type: ignore[union-attr]
        failed = self._promote(plan)
        for i, ev in waits:
            ev.wait()
            if DEVICE not in chain[i].loc or chain[i].dead:
                failed = min(failed, i) if failed is not None else i
        if failed is not None:
            with self._lock:
                self._release_blocks(chain[failed:])
                chain = chain[:failed]
        return Lease(
            store=self, layout=self.layout, keys=tuple(b.key for b in chain),
            slots=tuple(b.loc[DEVICE] for b in chain), pool=self.device.pool, blocks=chain,
        )

    def _promote(self, plan: list[tuple[int, Block, int, TierName]]) -> int | None:
        """Copy planned pages into their device slots, outside the lock (the blocks are
        leased and busy, so nothing moves them). Returns the chain position of the first
        block that failed (quarantined), or None."""
        outcomes: list[tuple[int, Block, int, str | None]] = []
        for i, b, slot, src in plan:
            err: str | None = None
            try:
                if src == HOST:
                    self.device.write(slot, self.host.page(b.loc[HOST]))
                else:
                    page = self.disk.read_page(b.loc[DISK])
                    if page_checksum(b.key, page) != b.checksum:
                        err = "page checksum mismatch on read"
                    else:
                        self.device.write(slot, page)
            except OSError as e:
                err = f"read failed: {e}"
            outcomes.append((i, b, slot, err))
        first_bad: int | None = None
        with self._lock:
            for i, b, slot, err in outcomes:
                b.busy -= 1
                if err is None and not b.dead:
                    self.table.place(b, DEVICE, slot)
                    self.stats_counters.promoted_bytes += self.layout.page_bytes
                else:
                    self.device.slots.free(slot)
                    if err is not None:
                        self._quarantine(b, err)
                    first_bad = i if first_bad is None else min(first_bad, i)
                self._promoting.pop(b.key).set()
        return first_bad

    def _release_blocks(self, blocks: list[Block]) -> None:
        """Drop one lease from each block (held: the lock); free retired blocks whose last
        lease this was; drop ephemeral blocks when their lease ends."""
        for b in blocks:
            if b.leases <= 0:
                raise LeaseError(f"block {b.key.hex()[:12]} released more often than leased")
            b.leases -= 1
            if b.leases or b.busy:
                continue
            if b.dead:
                if b in self._dead:
                    self._dead.remove(b)
                    self._free_detached(b)
            elif b.priority == Priority.EPHEMERAL:
                self._retire(b)

    def release(self, lease: Lease) -> None:
        """End a lease; its blocks become evictable again. Releasing twice is an error."""
        if lease.store is not self:
            raise LeaseError("lease released on a store that did not issue it")
        with self._lock:
            if lease.released:
                raise LeaseError("lease released twice")
            lease.released = True
            self._release_blocks(lease.blocks)

    # ---- put -------------------------------------------------------------------------
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
        self._check_usable()
        arr = as_token_array(tokens)
        n_full = len(arr) // self.layout.block_size
        n = int(pages.shape[0]) if isinstance(pages, torch.Tensor) and pages.dim() > 0 else 0
        self.layout.check_pages(pages)
        if start_block < 0 or start_block + n > n_full:
            from .errors import PageFormatError

            raise PageFormatError(
                f"{n} pages from block {start_block} exceed the {n_full} full blocks of {len(arr)} tokens"
            )
        keys = list(iter_block_keys(arr[: (start_block + n) * self.layout.block_size], scope.seed,
                                    self.layout.block_size, block_extra))
        bs = self.layout.block_size
        durable_wanted = priority == Priority.PINNED or (self.config.write_through and priority != Priority.EPHEMERAL)
        new: list[Block] = []
        page_of: dict[bytes, torch.Tensor] = {}
        disk_plan: list[tuple[int, Block]] = []
        with self._lock:
            for i in range(start_block, start_block + n):
                if keys[i] in self._writing or self.table.get(keys[i]) is not None:
                    continue
                self._writing.add(keys[i])
                page = page_of[keys[i]] = pages[i - start_block]
                b = Block(
                    key=keys[i], parent=keys[i - 1] if i else scope.seed, model_version=scope.model_version,
                    namespace=scope.namespace, tokens=arr[i * bs : (i + 1) * bs].tobytes(),
                    checksum=page_checksum(keys[i], page), priority=priority,
                )
                new.append(b)
            durable = durable_wanted and bool(self.disk.capacity_slots) and not self.disk.degraded
            if durable:
                for b in new:
                    loc = self._alloc_disk(b.model_version)
                    if loc is None:
                        durable = False
                        break
                    disk_plan.append((loc, b))
        try:
            if durable and disk_plan:
                items = [(loc, page_of[b.key].detach().cpu()) for loc, b in disk_plan]
                # Order matters: pages written and fsynced, then the index commit, then we ack.
                with self._io_lock:
                    self.disk.write_pages(items)
                    self.index.put_blocks(self._record(b, loc) for loc, b in disk_plan)
        except BaseException:
            with self._lock:
                for loc, _ in disk_plan:
                    self.disk.free(loc)
                self._writing.difference_update(b.key for b in new)
            raise
        with self._lock:
            for loc, b in disk_plan:
                self.table.add(b)
                self.table.place(b, DISK, loc)
            for b in new:
                if self.table.get(b.key) is None:
                    self.table.add(b)
                slot = self._alloc_mem(DEVICE)
                if slot is None:
                    slot_host = self._alloc_mem(HOST)
                    if slot_host is not None:
                        self.host.write(slot_host, page_of[b.key])
                        self.table.place(b, HOST, slot_host)
                else:
                    self.device.write(slot, page_of[b.key])
                    self.table.place(b, DEVICE, slot)
                if not b.loc:
                    self.table.remove(b)  # nowhere to keep it: the put stored nothing for it
                self._writing.discard(b.key)
            chain = [blk for k in keys if (blk := self.table.get(k)) is not None]
            self.table.touch_chain(chain)
            self.stats_counters.puts += 1
            self.stats_counters.blocks_stored += len(new)
            all_durable = all((blk := self.table.get(k)) is not None and DISK in blk.loc for k in keys[start_block:])
        return PutResult(stored=len(new), skipped=n - len(new), durable=all_durable)

    def prefetch(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                 block_extra: Sequence[Sequence[str | bytes]] | None = None) -> Future[int]:
        """Start promoting the cached prefix of ``tokens`` to the device tier in the
        background; the future gives the number of tokens now warm. Nothing stays leased."""
        self._check_usable()
        arr = as_token_array(tokens)

        def run() -> int:
            with self.acquire(arr, scope, block_extra) as lease:
                return lease.tokens_matched

        return self._executor.submit(run)

    def close(self) -> None:
        """Write memory-only blocks to disk (write-back), then release everything."""
        if self._closed or os.getpid() != self._pid:
            return
        self._executor.shutdown(wait=True)
        with self._lock:
            if not self.config.write_through:
                for b in list(self.table.blocks.values()):
                    if DISK not in b.loc and b.priority != Priority.EPHEMERAL and not b.dead:
                        self._flush_to_disk(b)
            self._closed = True
            self.device.close()
            self.host.close()
            self.disk.close()
            self.index.close()
            self._home_lock.release()

    def _flush_to_disk(self, b: Block) -> None:
        """Write a memory-only block to disk (write-back on eviction from host, pinning, or
        close). Held: the lock; the disk I/O runs under it because the caller needs the
        result before it can go on. A failure leaves the block in memory only."""
        if not self.disk.capacity_slots or self.disk.degraded:
            return
        src = DEVICE if DEVICE in b.loc else HOST
        page = self._tier(src).page(b.loc[src]).cpu()
        loc = self._alloc_disk(b.model_version)
        if loc is None:
            return
        try:
            self.disk.write_pages([(loc, page)])
            self.index.put_blocks([self._record(b, loc)])
        except DiskWriteError:
            self.disk.free(loc)
            return
        self.table.place(b, DISK, loc)
        self.stats_counters.demoted_bytes += self.layout.page_bytes

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
