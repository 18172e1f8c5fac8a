"""The page layouts one daemon serves: a store (tiers, index, segments) and a staging region
per layout, all under the one home.

    HOME/LOCK, index/, segments/    the first layout (so ``tierkv.open(HOME)`` and every
                                    ``--home`` command keep working on a one-model home)
    HOME/layouts/<layout-id>/       each further layout: its own LOCK, index/, segments/

A client declares its layout when it connects (HELLO); the daemon opens that layout's store
on first use, or finds it at start. A layout never changes in place: a store's layout is
fixed, so a second model with other KV shapes gets a store of its own.

Budgets. ``device_bytes``, ``host_bytes`` and ``disk_bytes`` are daemon-wide budgets shared
by the layouts: the memory tiers among the N in use, ``budget // N`` each, the disk among
all open ones (home/budgets.py: a layout idle for ``layout_idle_s`` gives its memory share back;
the one layout of a one-model daemon gets the whole budget). A new layout is checked (its
page must fit its share) and its store opened with limits of 0; only then are the open ones
lowered to their new shares (each evicts down to it through the store's normal eviction,
:meth:`tierkv.Store.set_tier_limits`) and the new one raised to it. At
most ``max_layouts`` layouts open (CapacityError beyond); ``staging_bytes`` is split as a
fixed ``1/max_layouts`` per layout (clients write into it; it holds nothing between requests).

How a share is enforced: each layout's tiers are *mapped* at the whole budget (a shared-memory
file is sparse: a page costs memory only once touched) and *used* up to a limit that bounds
slot positions as well as counts. So memory above a limit is never touched, the
background populator stops at the limit, and lowering a limit evicts down to it (the policy's
victims), moves the memory-tier blocks still placed above it to free slots below, evicts
what cannot move, and gives the pages above back (MADV_REMOVE) as they go
(tierkv/core/tier_limits.py); on disk, segments above the limit are emptied and deleted and no
new one is made while as many files exist. The sum of the limits
never exceeds a budget, so the memory and files actually in use never do either, except
for what a lowering could not evict yet: a leased, in-flight or pinned block (and its prefix)
stays until released, and meanwhile its tier allocates only while its use is below the
limit (so it never grows past it); the daemon retries every second (:meth:`Layouts.retrim`).
A layout stays open until the daemon stops or ``tierkv layouts rm`` removes it (its files go,
and the others' limits rise to the new share); a restart gives each layout ``1/N``. Tiers that cannot be sparse are mapped at a fixed share,
``budget // max_layouts``, and limited within it: a CUDA device pool (one allocation of GPU
memory, shared with clients by an IPC handle) and, on a CUDA host, the page-locked host pool
(cudaHostRegister locks every page of the mapping).

Rejected: a fixed share ``budget // max_layouts`` for every tier (what this replaced: a
daemon serving one model used a quarter of its memory); resizing the mappings as layouts
come and go (clients hold them, and a moved mapping would move pages under live leases);
one byte budget checked at each allocation (a store's eviction would have to reach into the
other stores); and a limit on counts only (eviction down to a count leaves pages touched
all over the mapping: up to twice the share in memory).
"""
from __future__ import annotations

import logging
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, AbstractSet, Callable, Union

import torch

from ..api import StoreAPI
from ..errors import CapacityError, ConfigError, LayoutInUseError, NotFoundError, QuotaExceededError
from ..home.lock import HomeLock, LentLock
from ..home.directory import CREATOR, LAYOUTS_DIR, find_layouts, layout_id, read_creator, remove_store_files
from ..layout import PageLayout
from ..core.store import Store
from ..tiers.shm import SharedRegion
from . import regions
from .leases import StagingSlots
from ..home.budgets import Budget, TierLimits, apply_in_order, check_fits

if TYPE_CHECKING:
    from ..cluster.node import ClusterNode

log = logging.getLogger(__name__)
# What a layout is served by: its Store, or a ClusterNode around it when the remote tier is
# on. Both are StoreAPIs; the daemon also reaches the local Store for what only it has
# (the memory tiers clients map, limits, resident acquires, pinned counts).
ServedStore = Union[Store, "ClusterNode"]
OpenStore = Callable[[Path, PageLayout, TierLimits, LentLock | None], tuple[ServedStore, Store]]


def local_of(store: ServedStore) -> Store:
    """The local Store of a served store (a ClusterNode wraps one)."""
    return store if isinstance(store, Store) else store.store


@dataclass(eq=False)
class LayoutEntry:
    """One served layout: its store (a Store, or a ClusterNode around one) and the local
    Store whose memory tiers clients map, where it lives, and the staging slots clients of
    this layout write new pages into."""

    layout_id: str
    layout: PageLayout
    home: Path
    store: ServedStore
    local: Store
    staging_region: SharedRegion
    staging_pool: torch.Tensor
    staging: StagingSlots
    over_limit: int = 0  # slots still used above its limits (held when they were lowered)
    creator: int | None = None  # the other uid whose HELLO made it (None: the daemon's own)
    limits: TierLimits = TierLimits(0, 0, 0)  # its share now (home/budgets.py)
    # When a connection was last seen bound to it (monotonic; server.py): opening counts.
    last_bound: float = field(default_factory=time.monotonic)

    def close(self) -> None:
        self.store.close()
        self.staging_region.close()


class Layouts:
    """Layout id -> :class:`LayoutEntry`. Opening is serialised by a lock (a store open takes
    seconds on a big tier and must happen once per layout); lookups of open entries are
    plain dict reads, safe from the event loop while another thread opens a layout."""

    def __init__(self, home: Path, socket_path: str, max_layouts: int, budget: Budget, shm_dir: Path,
                 open_store: OpenStore) -> None:
        self.home = home
        self.socket_path = socket_path
        self.max_layouts = max_layouts
        self.budget = budget
        self.shm_dir = shm_dir
        self._open_store = open_store
        self._entries: dict[str, LayoutEntry] = {}
        self._lock = threading.Lock()
        self._home_lock: HomeLock | None = None
        self._root_used = False
        self._removing: set[str] = set()  # taken out by take(), not dropped yet
        self._in_use: set[str] = set()  # the layouts whose memory shares are not 0 (home/budgets.py)

    # ---- opening -----------------------------------------------------------------------
    def start(self, preset: PageLayout | None = None) -> None:
        """Take the home and open every store it holds (and ``preset``, the ``--layout`` of
        the command line). The daemon holds the home's LOCK until it closes, lending it to
        the store at the root (home.LentLock), so no other process opens the home meanwhile."""
        self._home_lock = HomeLock(self.home, self.socket_path)
        found = find_layouts(self.home)
        if len(found) > self.max_layouts:
            self.close()
            raise ConfigError(f"{self.home} holds {len(found)} layouts, more than max_layouts={self.max_layouts}",
                              hint=f"start the daemon with --max-layouts {len(found)} or more")
        self._root_used = any(h == self.home for h, _ in found)
        # Every store opens with its share of all that start opens: none fills a share
        # that the next open would take back (a lowered disk limit deletes pages).
        n = len(found) + (preset is not None and all(preset != lo for _, lo in found))
        try:
            for home, layout in found:
                entry = self._add(home, layout, self.budget.share(n))
                entry.creator = read_creator(home)
                entry.limits = self.budget.share(n)
                self._entries[entry.layout_id] = entry
                self._in_use.add(entry.layout_id)  # until the daemon's loop finds it idle
            if preset is not None:
                self.open(preset)
        except BaseException:
            self.close()
            raise

    def open(self, layout: PageLayout, creator: int | None = None, layouts_per_uid: int = 1) -> LayoutEntry:
        """The entry of ``layout``, opening (creating) its store on first use; ``creator``
        is the uid asking when it is not the daemon's own. Raises CapacityError when
        ``max_layouts`` layouts are open already, QuotaExceededError when ``creator`` made
        ``layouts_per_uid`` of them (quotas.py)."""
        lid = layout_id(layout)
        entry = self._entries.get(lid)
        if entry is not None:
            return entry
        with self._lock:
            entry = self._entries.get(lid)
            if entry is not None:
                return entry
            if lid in self._removing:
                raise LayoutInUseError(f"layout {lid} is being removed", hint="retry when `tierkv layouts` no longer "
                                                                              "lists it")
            if len(self._entries) >= self.max_layouts:
                raise CapacityError(
                    f"the daemon serves {len(self._entries)} page layouts already "
                    f"({', '.join(self._entries)}); max_layouts is {self.max_layouts}",
                    hint="restart the daemon with a larger --max-layouts")
            made = sum(1 for e in self._entries.values() if creator is not None and e.creator == creator)
            if creator is not None and made >= layouts_per_uid:
                raise QuotaExceededError(
                    f"uid {creator} made {made} of the daemon's page layouts already (layouts_per_uid = "
                    f"{layouts_per_uid}); layout {lid} is not served",
                    hint="use a layout the daemon serves (tierkv layouts), or ask its operator to open this one")
            # The first layout lives at the root; the root stays free for the next one when
            # its open fails (issue 34, item 4).
            home = self.home if not self._root_used else self.home / LAYOUTS_DIR / lid
            fresh = home != self.home and not home.exists()  # removed again if the open fails
            log.info("opening a store for layout %s at %s", lid, home)
            before = {e.layout_id: e for e in self.entries()}
            target = self.budget.plan([*before, lid], self._in_use | {lid})  # it is in use: a HELLO asks
            check_fits(lid, layout, target[lid])  # before anything is evicted or written (issue 34, items 2-3)
            # The new store opens with limits of 0 (it is new: start() opened every store the
            # home holds, so it holds nothing and touches no memory at 0); only once it and
            # its staging exist do the open layouts evict down to their new shares, and then
            # it gets its share, so the budgets hold at every moment. Rejected: lowering the
            # open layouts first and raising them back if the open failed (what this
            # replaced): a refused layout had already deleted their disk blocks, 1,472 of
            # 1,760 in issue 34, item 3.
            try:
                entry = self._add(home, layout, TierLimits(0, 0, 0))
            except BaseException:
                if fresh:  # a refused layout leaves nothing a restart would find
                    shutil.rmtree(home, ignore_errors=True)
                raise
            try:
                if creator is not None:  # before anything gives up room: a restart counts it too
                    (home / CREATOR).write_text(str(creator))
                    entry.creator = creator
                self._apply({**before, lid: entry}, target)
            except BaseException:
                entry.close()
                (home / CREATOR).unlink(missing_ok=True)
                raise
            self._in_use.add(lid)
            self._entries[entry.layout_id] = entry  # served only with its share
            self._root_used = True
            return entry

    def _apply(self, entries: dict[str, LayoutEntry], target: dict[str, TierLimits]) -> None:
        """Give ``entries`` their ``target`` limits, every lowering first (home/budgets.py)."""
        def set_limits(lid: str, limits: TierLimits) -> None:
            e = entries[lid]
            e.over_limit = e.local.set_tier_limits(limits.device_bytes, limits.host_bytes, limits.disk_bytes)
            e.limits = limits
            if e.over_limit:
                log.warning("layout %s: %d slots stay above its new limits until their leases, reads or pins "
                            "end", e.layout_id, e.over_limit)

        apply_in_order({lid: e.limits for lid, e in entries.items()}, target, set_limits)

    @property
    def in_use(self) -> frozenset[str]:
        return frozenset(self._in_use)

    def rebalance(self, in_use: AbstractSet[str], as_of: float | None = None) -> None:
        """Share the memory tiers among the layouts ``in_use`` (the daemon's loop, when one
        turns idle; a HELLO, when an idle one is wanted again); a no-op when that is how
        they are shared already. Runs in a worker thread (lowering a limit evicts). The
        loop's set was seen at ``as_of``: a layout a HELLO bound since stays in use (its
        rebalance may have run first)."""
        with self._lock:
            entries = {e.layout_id: e for e in self.entries()}
            in_use = set(in_use) & set(entries)
            if as_of is not None:
                in_use |= {lid for lid, e in entries.items() if e.last_bound >= as_of}
            if in_use == self._in_use:
                return
            log.info("layouts in use: %s (idle: %s)", ", ".join(sorted(in_use)) or "none",
                     ", ".join(sorted(set(entries) - in_use)) or "none")
            self._apply(entries, self.budget.plan(entries, in_use))
            self._in_use = in_use

    def retrim(self) -> int:
        """Evict again what stayed above a lowered limit (its holders may be gone); returns
        the slots still above. Cheap when nothing stayed: the daemon calls it every second."""
        left = 0
        with self._lock:
            for e in self.entries():
                if e.over_limit:
                    e.over_limit = e.local.set_tier_limits()
                    left += e.over_limit
        return left

    def _add(self, home: Path, layout: PageLayout, limits: TierLimits) -> LayoutEntry:
        lent = LentLock(self._home_lock) if home == self.home and self._home_lock is not None else None
        store, local = self._open_store(home, layout, limits, lent)
        try:
            region, pool = regions.create_staging(self.shm_dir, layout, self.budget.staging_bytes)
        except BaseException:
            store.close()
            raise
        quota = max(1, self.budget.client_staging_bytes // layout.page_bytes)
        entry = LayoutEntry(layout_id(layout), layout, home, store, local, region, pool,
                            StagingSlots(pool.shape[0], quota))
        return entry  # the caller serves it (self._entries) once its limits are set

    # ---- removing (tierkv layouts rm) ----------------------------------------------------
    def take(self, lid: str) -> LayoutEntry:
        """Take ``lid`` out of the served layouts (on the event loop, right after checking no
        connection is bound to it: no HELLO binds it from then on, and an open of it raises
        LayoutInUseError until :meth:`drop`). NotFoundError when it is not served."""
        entry = self._entries.get(lid)
        if entry is None:
            raise NotFoundError(f"the daemon serves no layout {lid} (it serves {', '.join(self._entries) or 'none'})",
                                hint="list them with `tierkv layouts`")
        self._removing.add(lid)
        del self._entries[lid]
        return entry

    def drop(self, entry: LayoutEntry) -> None:
        """Close the store :meth:`take` took out, delete its files, and give its share of the
        budgets back to the layouts still open (their limits rise to the new share). Runs
        in a worker thread."""
        with self._lock:
            try:
                entry.close()
                if entry.home == self.home:  # the next new layout opens at the root
                    self._root_used = False  # (the daemon kept the LOCK: it lent it)
                remove_store_files(self.home, entry.home)
                rest = {e.layout_id: e for e in self.entries()}
                self._in_use.discard(entry.layout_id)
                self._apply(rest, self.budget.plan(rest, self._in_use))
            finally:
                self._removing.discard(entry.layout_id)

    # ---- reading -----------------------------------------------------------------------
    def get(self, lid: str) -> LayoutEntry | None:
        return self._entries.get(lid)

    def entries(self) -> list[LayoutEntry]:
        """Open entries, the root's first (a snapshot: safe while another layout opens)."""
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def entry_of(self, store: StoreAPI) -> LayoutEntry:
        """The entry serving ``store`` (one of a Home view over the served stores);
        NotFoundError when its layout was removed meanwhile."""
        for e in self.entries():
            if e.store is store:
                return e
        raise NotFoundError("the layout of this chain is no longer served (removed meanwhile)",
                            hint="list the daemon's layouts with `tierkv layouts`")

    def only(self) -> LayoutEntry | None:
        """The entry when exactly one layout is open (what a client that declares none gets)."""
        entries = self.entries()
        return entries[0] if len(entries) == 1 else None

    def set_client_quota(self, client_staging_bytes: int) -> None:
        for e in self.entries():
            e.staging.quota = min(max(1, client_staging_bytes // e.layout.page_bytes), e.staging.slots.capacity)

    # ---- closing -----------------------------------------------------------------------
    def close(self) -> None:
        """Close every store (flushing write-back blocks) and staging region; release the home."""
        for e in self.entries():
            try:
                e.close()
            except Exception:  # noqa: BLE001 - one failing store must not keep the others open
                log.exception("closing layout %s failed", e.layout_id)
        self._entries.clear()
        if self._home_lock is not None:
            self._home_lock.release()
            self._home_lock = None

    def check_integrity(self) -> None:
        assert len(self._entries) <= self.max_layouts
        for lid, e in self._entries.items():
            assert lid == layout_id(e.layout) and e.store.layout == e.layout
            e.staging.check_integrity()
            e.store.check_integrity()
        # The limits add up to no more than the budgets (the shares of the layouts open).
        for tier, budget in (("device", self.budget.device_bytes), ("host", self.budget.host_bytes),
                             ("disk", self.budget.disk_bytes)):
            assert sum(getattr(e.local, tier).capacity_bytes for e in self._entries.values()) <= budget, \
                f"{tier}: the layouts' limits exceed the daemon's budget"
