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
from typing import Callable, Sequence

import numpy as np
import torch

from .api import StoreAPI
from .blocks import Block, BlockTable, Priority
from .config import StoreConfig
from .errors import ForkedStoreError, LayoutMismatchError, LeaseError, NotFoundError, TierKVError
from .eviction import EvictedBlock, EvictionListeners
from .home import HomeLock
from .identity import Scope, as_token_array, iter_block_keys
from .index import NO_DISK, Index
from .layout import PageLayout
from .ingest import Ingest
from .operations import StoreOperations
from .promotion import PlannedRead, Promotion
from .results import Lease, LookupResult
from .stats import Counters
from .tiers import DiskTier, MemoryTier, TierName
from .tiers.shm import default_shm_dir, reap_stale_regions

log = logging.getLogger(__name__)
FORMAT_VERSION = "1"
DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK


class Store(StoreOperations, Ingest, Promotion, StoreAPI):
    """A tierkv store opened in this process. Build with :func:`tierkv.open`.

    The read path (lookup, acquire, release, prefetch) lives here, the reads that bring
    blocks into the device tier in :class:`~tierkv.promotion.Promotion`; ``put`` in
    :class:`~tierkv.ingest.Ingest`; operations (pin,
    invalidate, verify, stats, manifests) in :class:`~tierkv.operations.StoreOperations`;
    the placement machinery (allocation, eviction, demotion, write-back, retirement) in
    :class:`~tierkv.placement.Placement`."""

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
            reap_stale_regions(shm_dir)  # tiers of killed processes: nobody else unlinks them
            cuda = torch.cuda.is_available()
            self.device = MemoryTier(DEVICE, self.layout, config.device_bytes, config.resolved_device(), shm_dir)
            self.host = MemoryTier(HOST, self.layout, config.host_bytes, "cpu", shm_dir, pin=cuda)
            self.disk = DiskTier(
                home / "segments", self.layout, config.disk_bytes, config.segment_pages,
                odirect=config.odirect, fsync=config.fsync,
            )
            self.table = BlockTable(config.eviction_policy, {
                DEVICE: self.device.slots.capacity, HOST: self.host.slots.capacity, DISK: self.disk.capacity_slots,
            })
            self.eviction_listeners = EvictionListeners()
            self.stats_counters = Counters()
            self._writing: set[bytes] = set()
            self._promoting: dict[bytes, threading.Event] = {}
            self._dead: list[Block] = []
            self._load_index()
            self._executor = ThreadPoolExecutor(max(1, config.prefetch_workers), thread_name_prefix="tierkv-prefetch")
            # Verifies promoted pages while the next run is read (xxhash releases the GIL).
            self._checksummer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-verify")
        except BaseException:
            # Close what was opened: the LMDB environment (opening it twice in one process
            # breaks its locking) and the shared-memory files (nothing else unlinks them).
            for part in ("device", "host", "disk", "index"):
                if hasattr(self, part):
                    getattr(self, part).close()
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
            if rec.priority not in set(Priority) or len(rec.tokens) != 4 * self.layout.block_size:
                self._quarantine_key(key, "index record out of range")
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

    def add_eviction_listener(self, fn: Callable[[EvictedBlock], None],
                              wants: Callable[[str, Priority], bool] | None = None) -> None:
        """Call ``fn`` with an :class:`~tierkv.eviction.EvictedBlock` (metadata and a CPU
        copy of the page) whenever a block that ``wants(namespace, priority)`` accepts
        leaves its last local tier. ``fn`` runs under the store lock: it must be quick and
        must not call the store (see :mod:`tierkv.eviction`)."""
        self.eviction_listeners.add(fn, wants)

    def remove_eviction_listener(self, fn: Callable[[EvictedBlock], None]) -> None:
        self.eviction_listeners.remove(fn)

    # ---- lookup ----------------------------------------------------------------------
    def _match(self, arr: np.ndarray, scope: Scope, block_extra: Sequence[Sequence[str | bytes]] | None) -> list[Block]:
        """The longest chain of stored blocks for ``arr`` whose token ids equal the
        request's (held: the lock). A block whose stored ids differ is a collision or a
        corrupt record: quarantined, and the chain ends there."""
        bs = self.layout.block_size
        step = 4 * bs
        raw = arr.tobytes()
        get = self.table.blocks.get
        chain: list[Block] = []
        for i, key in enumerate(iter_block_keys(arr, scope.seed, bs, block_extra)):
            b = get(key)
            if b is None or b.dead:
                break
            if b.tokens != raw[i * step : (i + 1) * step]:
                self.stats_counters.token_mismatch += 1
                self._quarantine(b, "stored token ids differ from the request's")
                break
            chain.append(b)
        return chain

    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
               block_extra: Sequence[Sequence[str | bytes]] | None = None) -> LookupResult:
        """Longest cached prefix of ``tokens`` across all tiers, token ids verified.

        A lookup is a probe, not a use: it does not refresh the blocks' LRU position
        (``acquire`` and ``put`` do). Refreshing 8k blocks cost a third of a 128k-token lookup."""
        self._check_usable()
        arr = as_token_array(tokens)
        t0 = time.perf_counter()
        with self._lock:
            chain = self._match(arr, scope, block_extra)
            tiers = tuple(b.top for b in chain)
            self.stats_counters.record_lookup(len(arr) // self.layout.block_size, tiers, time.perf_counter() - t0)
        return LookupResult(len(chain) * self.layout.block_size, tuple(b.key for b in chain), tiers)

    # ---- acquire / release -------------------------------------------------------------
    def acquire(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None,
                start_block: int = 0) -> Lease:
        """Lease the longest cached prefix, promoted into the device tier.

        ``start_block``/``max_blocks`` lease only blocks ``start_block ..`` of that prefix
        (the whole prefix is still matched and verified), so a prefix larger than the device
        tier can be read a window at a time.

        The lease covers fewer blocks than ``lookup`` finds when the device tier cannot hold
        them all (other leases), a page fails verification (it is quarantined) or cannot be
        read (an I/O error: the block stays stored, the disk tier is marked read-degraded),
        or another thread's read of a block does not finish within ``PROMOTION_WAIT_S``.
        Leased blocks are never evicted, moved or overwritten until :meth:`release`.
        """
        self._check_usable()
        arr = as_token_array(tokens)
        with self._lock:
            if start_block < 0:
                raise ValueError("start_block must be >= 0")
            chain = self._match(arr, scope, block_extra)[start_block:]
            if max_blocks is not None:
                chain = chain[:max_blocks]
            self.table.touch_chain(chain)
            plan: list[PlannedRead] = []
            waits: list[tuple[int, threading.Event]] = []
            # Lease block by block: blocks further along the chain are not leased yet, so
            # making room may evict them; the lease stops where the device tier is full.
            leased = 0
            try:
                for i, b in enumerate(chain):
                    if b.dead or not b.loc:
                        # Making room for an earlier block evicted this one from every tier.
                        chain = chain[:i]
                        break
                    self.table.lease(b)
                    leased = i + 1
                    if DEVICE in b.loc:
                        continue
                    if b.key in self._promoting:
                        waits.append((i, self._promoting[b.key]))
                        continue
                    slot = self._alloc_mem(DEVICE)
                    if slot is None:
                        self._release_blocks([b], ended=False)
                        chain = chain[:i]
                        break
                    plan.append(self._plan_read(i, b, slot))
            except BaseException:
                # Making room failed (the index could not record an eviction): undo this
                # acquire's leases and plans so that nothing stays pinned or waited on.
                try:
                    self._settle(plan)  # nothing was read: every slot freed, every waiter woken
                finally:
                    self._release_blocks(chain[:leased], ended=False)
                raise
            self.stats_counters.record_acquire(tuple(b.top for b in chain))
        try:
            failed = self._promote(plan)
            failed = self._await_reads(waits, chain, failed)
        except BaseException:
            with self._lock:
                self._release_blocks(chain, ended=False)  # the lease is never handed out
            raise
        if failed is not None:
            with self._lock:
                self._release_blocks(chain[failed:], ended=False)
                chain = chain[:failed]
        return Lease(
            store=self, layout=self.layout, keys=tuple(b.key for b in chain),
            slots=tuple(b.loc[DEVICE] for b in chain), pool=self.device.pool, blocks=chain,
            start_block=start_block,
        )

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
        """Write memory-only blocks to disk (write-back), then release everything: the
        shared memory, the index and the home lock are released even when the final
        write-back fails (what could not be written is logged and counted, and lost: with
        ``write_through=False`` it was never acknowledged as durable)."""
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self._executor.shutdown(wait=True)
            self._checksummer.shutdown(wait=True)
            with self._lock:
                self._closed = True
                if not self.config.write_through:
                    self._flush_all()
        finally:
            with self._lock:
                self._closed = True
                for part in (self.device, self.host, self.disk, self.index):
                    try:
                        part.close()
                    except Exception:  # noqa: BLE001 - the other parts and the lock still go
                        log.exception("closing %s failed", type(part).__name__)
                self._home_lock.release()

    def _flush_all(self) -> int:
        """Write-back at close (held: the lock); returns how many blocks stayed memory-only."""
        lost = 0
        for b in list(self.table.blocks.values()):
            if DISK in b.loc or b.priority == Priority.EPHEMERAL or b.dead:
                continue
            try:
                ok = self._flush_to_disk(b)
            except TierKVError as e:
                log.error("close: writing block %s to disk failed: %s", b.key.hex()[:16], e)
                ok = False
            lost += not ok
        self.stats_counters.unflushed_at_close = lost
        if lost:
            log.error("close: %d memory-only block(s) could not be written to disk (disk degraded: %s)",
                      lost, self.disk.degraded_reason)
        return lost

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
