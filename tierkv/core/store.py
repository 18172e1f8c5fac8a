"""The store: the embedded API over the three tiers, the block table and the durable index.

The store is built from parts (see :class:`Store`); this module opens and closes them, and
holds the read path.

Concurrency: one lock (``placement.lock``) guards the block table and the slot allocators. Page
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
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Sequence, cast

import numpy as np
import torch

from ..api import StoreAPI
from .blocks import Block, Priority
from ..codec import open_home_codec
from ..config import StoreConfig
from ..errors import ForkedStoreError, LayoutMismatchError, NotFoundError
from .eviction import EvictedBlock
from ..home.lock import HomeLock, LentLock
from ..identity import Scope, as_token_array
from ..index import NO_DISK, Index
from ..layout import PageLayout
from .matching import match_chain
from .ingest import Ingest
from .operations import StoreOperations
from .placement import Placement
from ..process import current_pid
from .leasing import Leasing
from .promotion import Promotion
from .read_through import ReadThrough
from .warm_start import WarmStart, record as record_warm_set
from ..results import ChainTokens, InvalidateResult, LookupResult, PutResult, Residency, StoreStats, VerifyResult
from ..lease import Lease
from ..tiers import DiskTier, MemoryTier, TierName
from ..tiers.shm import default_shm_dir, reap_stale_regions

_PRIORITIES = {int(p): p for p in Priority}  # an index record's priority (read once per block at open)

log = logging.getLogger(__name__)
FORMAT_VERSION = "1"
DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK


class Store(StoreAPI):
    """A tierkv store opened in this process. Build with :func:`tierkv.open` (``home_lock``: home.LentLock).

    Built from parts, each given what it needs in its constructor:

    - ``placement`` (:class:`~tierkv.core.placement.Placement`) owns the block table, the tiers,
      the index, the lock and the eviction listeners; it allocates, evicts, demotes, writes
      back, retires and quarantines, and is the only code that moves pages between tiers;
    - ``ingest`` (:class:`~tierkv.core.ingest.Ingest`): ``put``;
    - ``promotion`` (:class:`~tierkv.core.promotion.Promotion`): the reads that bring leased
      blocks into the device tier;
    - ``leasing`` (:class:`~tierkv.core.leasing.Leasing`): ``acquire`` and ``release``, the
      leases' bookkeeping around those reads;
    - ``operations`` (:class:`~tierkv.core.operations.StoreOperations`): pinning, manifests,
      chains, invalidate, verify, stats.

    Lookup and prefetch, opening and closing live here. Every public method checks that the
    store is usable (open, and used by this process), then does its work or delegates it.
    ``index``, ``device``, ``host`` and ``disk`` are the placement's parts, for inspection
    (the daemon shares the memory tiers with its clients)."""

    def __init__(self, config: StoreConfig, socket_path: str | None = None, home_lock: LentLock | None = None) -> None:
        self.config = config
        self.layout: PageLayout = config.layout
        self._pid = os.getpid()
        self._closed = False
        home = config.home
        self._home_lock = home_lock or HomeLock(home, socket_path)  # a daemon's root store: lent one
        try:
            self.index = Index(home / "index", config.index_map_bytes)
            codec = open_home_codec(self.index, config.page_codec, self.layout, home)  # before a new home's layout
            new_home = self._check_layout()  # a new home's layout is recorded last (below)
            shm_dir = config.shm_dir or default_shm_dir()
            reap_stale_regions(shm_dir)  # tiers of killed processes: nobody else unlinks them
            cuda = torch.cuda.is_available()
            self.device = MemoryTier(DEVICE, self.layout, config.device_bytes, config.resolved_device(), shm_dir,
                                     codec=codec, limit_bytes=config.device_limit_bytes,
                                     populate=config.populate_memory, ahead_at_open=config.populate_device_ahead)
            self.host = MemoryTier(HOST, self.layout, config.host_bytes, "cpu", shm_dir, pin=cuda, codec=codec,
                                   limit_bytes=config.host_limit_bytes, populate=config.populate_memory)
            self.disk = DiskTier(
                home / "segments", self.layout, config.disk_bytes, config.segment_pages,
                odirect=config.odirect, direct_reads=config.direct_reads, fsync=config.fsync, codec=codec,
            )
            self.placement = Placement(config, self.index, self.device, self.host, self.disk)
            self._lock = self.placement.lock
            self.ingest = Ingest(self.placement)
            self.promotion = Promotion(self.placement)
            self.read_through = ReadThrough(self, self.placement, self.promotion)
            self.leasing = Leasing(self, self.placement, self.promotion, self.read_through)
            self.operations = StoreOperations(self.placement)
            self._load_index()
            if new_home:  # only now: a home whose tiers could not be built holds no layout (#34)
                self.index.put_meta("layout", self.layout.to_json())
                self.index.put_meta("format_version", FORMAT_VERSION)
            if config.disk_limit_bytes is not None:  # the memory tiers took theirs above
                self.set_tier_limits(disk_bytes=config.disk_limit_bytes)
            self._executor = ThreadPoolExecutor(max(1, config.prefetch_workers), thread_name_prefix="tierkv-prefetch")
            self.warm_start = WarmStart(self.placement, self.promotion)
            if config.warm_at_open:  # last: nothing after it can fail the open
                self.warm_start.start()
        except BaseException:
            # Close what was opened: the LMDB environment (opening it twice in one process
            # breaks its locking) and the shared-memory files (nothing else unlinks them).
            for part in ("promotion", "read_through", "ingest", "device", "host", "disk", "index"):
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
    def _check_layout(self) -> bool:
        """Whether the home is new (holds no layout yet); LayoutMismatchError for another."""
        stored = self.index.get_meta("layout")
        if stored is not None and stored != self.layout.to_json():
            raise LayoutMismatchError(f"{self.config.home} holds pages of layout {stored}, asked for {self.layout.to_json()}")
        return stored is None

    def _load_index(self) -> None:
        """Rebuild the block table from the index: drop entries whose page is missing, short
        or (with verify_on_open='full') fails its checksum; reclaim unreferenced slots."""
        placement, table = self.placement, self.placement.table
        for key, rec in self.index.iter_blocks():
            if rec is None:
                placement.quarantine_key(key, "undecodable index record")
                continue
            if rec.priority not in _PRIORITIES or len(rec.tokens) != 4 * self.layout.block_size:
                placement.quarantine_key(key, "index record out of range")
                continue
            if rec.disk_loc == NO_DISK or not self.disk.claim(rec.disk_loc, rec.model_version):
                placement.quarantine_key(key, "page missing or segment truncated")
                continue
            block = Block(key, rec.parent, rec.model_version, rec.namespace, rec.tokens, rec.checksum,
                          _PRIORITIES[rec.priority])
            table.add_unlinked(block)
            table.place(block, DISK, rec.disk_loc)
        table.rebuild_children()  # every parent link, in one pass
        if self.config.verify_on_open == "full":
            self.operations.verify(repair=True)
        self.disk.reclaim_empty()

    def _check_usable(self) -> None:
        if current_pid() != self._pid:
            raise ForkedStoreError(f"this store was opened by pid {self._pid}, used from pid {os.getpid()}")
        if self._closed:
            raise NotFoundError("the store is closed", hint="open it again with tierkv.open()")

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` has run (every method but ``close`` then raises)."""
        return self._closed

    def add_eviction_listener(self, fn: Callable[[EvictedBlock], None],
                              wants: Callable[[str, Priority], bool] | None = None) -> None:
        """Call ``fn`` with an :class:`~tierkv.core.eviction.EvictedBlock` (metadata and a CPU
        copy of the page) whenever a block that ``wants(namespace, priority)`` accepts
        leaves its last local tier. ``fn`` runs under the store lock: it must be quick and
        must not call the store (see :mod:`tierkv.core.eviction`)."""
        self.placement.eviction_listeners.add(fn, wants)

    def remove_eviction_listener(self, fn: Callable[[EvictedBlock], None]) -> None:
        self.placement.eviction_listeners.remove(fn)

    # ---- lookup ----------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
               block_extra: Sequence[Sequence[str | bytes]] | None = None) -> LookupResult:
        """Longest cached prefix of ``tokens`` across all tiers, token ids verified.

        A lookup is a probe, not a use: it does not refresh the blocks' LRU position
        (``acquire`` and ``put`` do). Refreshing 8k blocks cost a third of a 128k-token lookup."""
        return cast(LookupResult, self.try_lookup(tokens, scope, block_extra, wait=True))  # waited: never None

    def try_lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                   block_extra: Sequence[Sequence[str | bytes]] | None = None, wait: bool = False) -> LookupResult | None:
        """:meth:`lookup` if the store lock is free now (or ``wait``); None, nothing done,
        otherwise. The daemon answers lookups so, on its event loop (as acquire_resident)."""
        self._check_usable()
        arr = as_token_array(tokens)
        t0 = time.perf_counter()
        if not self._lock.acquire(blocking=wait):
            return None
        try:
            chain = match_chain(self.placement, arr, scope, block_extra)
            tiers = tuple(b.top for b in chain)
            self.placement.stats_counters.record_lookup(len(arr) // self.layout.block_size, tiers,
                                                        time.perf_counter() - t0)
        finally:
            self._lock.release()
        return LookupResult(len(chain) * self.layout.block_size, tuple(b.key for b in chain), tiers)

    # ---- acquire / release -------------------------------------------------------------
    def acquire(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None,
                start_block: int = 0, promote: bool = True) -> Lease:
        """:meth:`tierkv.api.StoreAPI.acquire` (tierkv/core/leasing.py; ``promote=False``:
        tierkv/core/read_through.py). The lease also stops short at a block another thread's read
        of which does not finish within ``PROMOTION_WAIT_S``; a read I/O error leaves the
        block stored and the disk tier read-degraded."""
        self._check_usable()
        return self.leasing.acquire(as_token_array(tokens), scope, block_extra, max_blocks, start_block, promote)

    def acquire_resident(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                         block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None,
                         start_block: int = 0) -> Lease | None:
        """:meth:`acquire`, but only when it can finish now without waiting: the store lock
        is free and every block of the window is in the device tier (or none matches), so
        nothing is read, evicted or waited for. Otherwise None, with nothing leased and no
        block marked used (the caller then calls :meth:`acquire`). The daemon answers most
        acquires so, on its event loop, without a hop to a worker thread."""
        self._check_usable()
        return self.leasing.acquire_resident(as_token_array(tokens), scope, block_extra, max_blocks, start_block)

    def release(self, lease: Lease) -> None:
        """End a lease; its blocks become evictable again. Releasing twice is an error."""
        self.leasing.release(lease)

    def try_release(self, lease: Lease) -> bool:
        """:meth:`release` if the store lock is free now; False (nothing done) otherwise."""
        return self.leasing.try_release(lease)

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

    # ---- put (tierkv.core.ingest) -------------------------------------------------------------
    def put(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, pages: torch.Tensor, scope: Scope, *,
            start_block: int = 0, block_extra: Sequence[Sequence[str | bytes]] | None = None,
            priority: Priority = Priority.NORMAL) -> PutResult:
        """See :meth:`tierkv.core.ingest.Ingest.put`."""
        self._check_usable()
        return self.ingest.put(tokens, pages, scope, start_block=start_block, block_extra=block_extra,
                               priority=priority)

    def block_keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, n_blocks: int | None = None,
                   block_extra: Sequence[Sequence[str | bytes]] | None = None) -> list[bytes]:
        """:func:`tierkv.identity.block_keys` of the first ``n_blocks`` (default: all), from the
        chain memo where it proves them: a prompt just looked up or stored is not hashed again."""
        arr, bs = as_token_array(tokens), self.layout.block_size
        n = len(arr) // bs if n_blocks is None else max(0, min(n_blocks, len(arr) // bs))
        return self.placement.chain_memo.chain_keys(arr, scope.seed, bs, n, block_extra)

    # ---- operations (tierkv.core.operations) ---------------------------------------------------
    def set_priority(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, priority: Priority) -> int:
        self._check_usable()
        return self.operations.set_priority(tokens, scope, priority)

    def set_priority_from(self, last_key: bytes, priority: Priority) -> int:
        self._check_usable()
        return self.operations.set_priority_from(last_key, priority)

    def chain_tokens(self, last_key: bytes) -> ChainTokens:
        self._check_usable()
        return self.operations.chain_tokens(last_key)

    def chain_residency(self, last_key: bytes) -> Residency:
        self._check_usable()
        return self.operations.chain_residency(last_key)

    def save_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        self._check_usable()
        self.operations.save_manifest(name, manifest)

    def get_manifest(self, name: str) -> dict[str, Any]:
        self._check_usable()
        return self.operations.get_manifest(name)

    def list_manifests(self) -> dict[str, dict[str, Any]]:
        self._check_usable()
        return self.operations.list_manifests()

    def delete_manifest(self, name: str) -> bool:
        self._check_usable()
        return self.operations.delete_manifest(name)

    def invalidate(self, *, model_version: str | None = None, namespace: str | None = None,
                   dry_run: bool = False) -> InvalidateResult:
        self._check_usable()
        return self.operations.invalidate(model_version=model_version, namespace=namespace, dry_run=dry_run)

    def verify(self, repair: bool = False) -> VerifyResult:
        self._check_usable()
        return self.operations.verify(repair)

    def pinned_blocks(self, namespace_prefix: str = "") -> int:
        self._check_usable()
        return self.operations.pinned_blocks(namespace_prefix)

    def stats(self, namespace_limit: int | None = None, namespace_after: str | None = None) -> StoreStats:
        self._check_usable()
        return self.operations.stats(namespace_limit, namespace_after)

    def check_integrity(self) -> None:
        """Recompute every part's totals from its source of truth, in one hold of the lock;
        AssertionError on a mismatch."""
        self._check_usable()
        with self._lock:
            self.placement.check_integrity(self.promotion.reserved_slots())
            self.ingest.check_integrity()
            self.promotion.check_integrity()
            self.read_through.check_integrity()
            self.warm_start.check_integrity()

    # ---- closing -------------------------------------------------------------------------
    def close(self) -> None:
        """Write memory-only blocks to disk (write-back), then release everything: the
        shared memory, the index and the home lock are released even when the final
        write-back fails (what could not be written is logged and counted, and lost: with
        ``write_through=False`` it was never acknowledged as durable)."""
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self.warm_start.stop()  # before the reads' verifier stops
            self._executor.shutdown(wait=True)
            self.promotion.close()
            self.read_through.close()
            self.ingest.close()
            with self._lock:
                self._closed = True
                if not self.config.write_through:
                    self.operations.flush_all()
                if self.config.warm_at_open:  # only a store that warms records (a CLI's must not)
                    record_warm_set(self.placement)
        finally:
            with self._lock:
                self._closed = True
                try:
                    self.placement.close()
                finally:
                    self._home_lock.release()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- tier limits: a daemon's layouts share its budgets (tierkv/daemon/layouts.py) --------
    def set_tier_limits(self, device_bytes: int | None = None, host_bytes: int | None = None,
                        disk_bytes: int | None = None) -> int:
        """Let each tier hold at most this many bytes from now on (None: keep its limit; at
        most the ``*_bytes`` it was opened with) and bring it under the new limits: the
        normal eviction down to the count, then blocks placed above a limit move below it,
        or are evicted (tierkv/core/tier_limits.py). A limit bounds slot positions as well as
        counts, so the memory beyond it is never touched and is given back.

        Blocks that cannot go now (leased, being read, pinned on disk, or a prefix of one of
        those) stay; the tier allocates only while its use is below the limit meanwhile.
        Returns how many slots are still used above the limits; call again (no arguments)
        to retry."""
        from .tier_limits import fit_under_limits

        self._check_usable()
        with self._lock:
            for tier, limit in ((self.device, device_bytes), (self.host, host_bytes), (self.disk, disk_bytes)):
                if limit is not None:
                    tier.set_limit(limit)
            return fit_under_limits(self.placement)

    def keys_of(self, *, model_version: str | None = None, namespace: str | None = None) -> list[bytes]:
        """The keys of the stored blocks of ``model_version`` and/or ``namespace``: what
        :meth:`invalidate` with the same arguments removes (a cluster node removes the
        remote tier's copies of these, whose objects are named by key)."""
        if model_version is None and namespace is None:
            raise ValueError("keys_of needs model_version or namespace")
        self._check_usable()
        with self._lock:
            return [b.key for b in self.placement.table.blocks.values()
                    if (model_version is None or b.model_version == model_version)
                    and (namespace is None or b.namespace == namespace)]
