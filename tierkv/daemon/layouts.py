"""The page layouts one daemon serves: a store (tiers, index, segments) and a staging region
per layout, all under the one home.

    HOME/LOCK, index/, segments/    the first layout (so ``tierkv.open(HOME)`` and every
                                    ``--home`` command keep working on a one-model home)
    HOME/layouts/<layout-id>/       each further layout: its own LOCK, index/, segments/

A client declares its layout when it connects (HELLO); the daemon opens that layout's store
on first use, or finds it at start. A layout never changes in place: a store's layout is
fixed, so a second model with other KV shapes gets a store of its own.

Budgets. ``device_bytes``, ``host_bytes``, ``disk_bytes`` and ``staging_bytes`` are
daemon-wide. Each layout's tiers get a fixed share, ``budget // max_layouts``, when it opens,
and at most ``max_layouts`` layouts open (CapacityError beyond). Rejected: resizing every
store's tiers as layouts come and go (memory tiers are single shared-memory mappings that
clients hold; shrinking one would move pages under live leases), and one byte budget checked
at each allocation (it would need the store's eviction to reach into other stores). A fixed
share is simple, can never overcommit, and its figures are what ``stats`` reports.
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import CapacityError, ConfigError
from ..home import HomeLock, peek_layout
from ..layout import PageLayout
from ..store import Store
from ..tiers.shm import SharedRegion
from . import regions
from .leases import StagingSlots

log = logging.getLogger(__name__)
LAYOUTS_DIR = "layouts"


def layout_id(layout: PageLayout) -> str:
    """A stable, readable name for a layout: ``bfloat16-l8-h4-d64-b128``."""
    return (f"{layout.dtype}-l{layout.num_layers}-h{layout.num_kv_heads}-d{layout.head_dim}"
            f"-b{layout.block_size}")


def find_layouts(home: Path) -> list[tuple[Path, PageLayout]]:
    """The stores a home holds, as (store home, layout): the root's first, then
    ``layouts/*`` by name. A directory whose name is not its layout's id is skipped
    (logged): it was not made by a daemon."""
    found: list[tuple[Path, PageLayout]] = []
    root = peek_layout(home)
    if root is not None:
        found.append((home, root))
    sub = home / LAYOUTS_DIR
    if sub.is_dir():
        for d in sorted(sub.iterdir()):
            layout = peek_layout(d) if d.is_dir() else None
            if layout is None:
                continue
            if d.name != layout_id(layout) or any(layout == lo for _, lo in found):
                log.warning("skipping %s: it holds layout %s, which its name or another store already has",
                            d, layout.to_json())
                continue
            found.append((d, layout))
    return found


@dataclass(frozen=True)
class Budget:
    """One layout's share of the daemon-wide capacities (bytes)."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int
    staging_bytes: int
    client_staging_bytes: int


@dataclass(eq=False)
class LayoutEntry:
    """One served layout: its store (a Store, or a ClusterNode around one) and the local
    Store whose memory tiers clients map, where it lives, and the staging slots clients of
    this layout write new pages into."""

    layout_id: str
    layout: PageLayout
    home: Path
    store: Any
    local: Store
    staging_region: SharedRegion
    staging_pool: torch.Tensor
    staging: StagingSlots

    def close(self) -> None:
        self.store.close()
        self.staging_region.close()


class Layouts:
    """Layout id -> :class:`LayoutEntry`. Opening is serialised by a lock (a store open takes
    seconds on a big tier and must happen once per layout); lookups of open entries are
    plain dict reads, safe from the event loop while another thread opens a layout."""

    def __init__(self, home: Path, socket_path: str, max_layouts: int, budget: Budget, shm_dir: Path,
                 open_store: Callable[[Path, PageLayout, Budget], tuple[Any, Store]]) -> None:
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

    # ---- opening -----------------------------------------------------------------------
    def start(self, preset: PageLayout | None = None) -> None:
        """Take the home and open every store it holds (and ``preset``, the ``--layout`` of
        the command line). The daemon holds the home's LOCK itself until a store lives at
        the root (that store then holds it), so no other process opens the home meanwhile."""
        found = find_layouts(self.home)
        if len(found) > self.max_layouts:
            raise ConfigError(f"{self.home} holds {len(found)} layouts, more than max_layouts={self.max_layouts}",
                              hint=f"start the daemon with --max-layouts {len(found)} or more")
        self._root_used = any(h == self.home for h, _ in found)
        if not self._root_used:
            self._home_lock = HomeLock(self.home, self.socket_path)
        try:
            for home, layout in found:
                self._add(home, layout)
            if preset is not None:
                self.open(preset)
        except BaseException:
            self.close()
            raise

    def open(self, layout: PageLayout) -> LayoutEntry:
        """The entry of ``layout``, opening (creating) its store on first use. Raises
        CapacityError when ``max_layouts`` layouts are open already."""
        lid = layout_id(layout)
        entry = self._entries.get(lid)
        if entry is not None:
            return entry
        with self._lock:
            entry = self._entries.get(lid)
            if entry is not None:
                return entry
            if len(self._entries) >= self.max_layouts:
                raise CapacityError(
                    f"the daemon serves {len(self._entries)} page layouts already "
                    f"({', '.join(self._entries)}); max_layouts is {self.max_layouts}",
                    hint="restart the daemon with a larger --max-layouts (each layout gets 1/N of the tier budgets)")
            if not self._root_used:
                # The first layout lives at the root. Hand the root's LOCK from the daemon to
                # the store: released here, taken again first thing in the store's open (the
                # window is a few microseconds; a process that slipped in gets the home and
                # this open fails with StoreLockedError, nothing is shared).
                assert self._home_lock is not None
                self._home_lock.release()
                self._home_lock = None
                self._root_used = True
                home = self.home
            else:
                home = self.home / LAYOUTS_DIR / lid
            log.info("opening a store for layout %s at %s", lid, home)
            return self._add(home, layout)

    def _add(self, home: Path, layout: PageLayout) -> LayoutEntry:
        store, local = self._open_store(home, layout, self.budget)
        try:
            region, pool = regions.create_staging(self.shm_dir, layout, self.budget.staging_bytes)
        except BaseException:
            store.close()
            raise
        quota = max(1, self.budget.client_staging_bytes // layout.page_bytes)
        entry = LayoutEntry(layout_id(layout), layout, home, store, local, region, pool,
                            StagingSlots(pool.shape[0], quota))
        self._entries[entry.layout_id] = entry
        return entry

    # ---- reading -----------------------------------------------------------------------
    def get(self, lid: str) -> LayoutEntry | None:
        return self._entries.get(lid)

    def entries(self) -> list[LayoutEntry]:
        """Open entries, the root's first (a snapshot: safe while another layout opens)."""
        return list(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

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


# ---- stats across layouts -----------------------------------------------------------------
_RATES = ("hit_rate", "hit_rate_by_tier", "mean_lookup_ms")  # recomputed from the summed counts


def _sum(values: list[Any]) -> Any:
    """Numbers add up, mappings merge key by key, anything else keeps the first value."""
    if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return sum(values)
    if all(isinstance(v, dict) for v in values):
        keys = list(dict.fromkeys(k for v in values for k in v))
        return {k: _sum([v[k] for v in values if k in v]) for k in keys}
    return values[0]


def merge_stats(per_layout: dict[str, dict[str, Any]], home: str) -> dict[str, Any]:
    """The stats of several layouts' stores (each StoreStats' JSON shape) as one: blocks,
    bytes and counters summed, rates recomputed from the sums, ``layout`` the only layout's
    or None, and ``layouts`` with each store's own figures (layout id -> its stats)."""
    from ..stats import Counters

    stores = list(per_layout.values())
    out: dict[str, Any] = _sum(stores) if stores else {
        "blocks": 0, "leased_blocks": 0, "model_versions": {}, "namespaces": {}, "disk_read_path": "",
        "tiers": {t: {"blocks": 0, "used_bytes": 0, "capacity_bytes": 0} for t in ("device", "host", "disk")},
        **Counters().as_dict(),
    }
    for name in _RATES:
        out.pop(name, None)
    lookups, asked = int(out.get("lookups", 0)), int(out.get("lookup_blocks", 0))
    hits = dict(out.get("hits", {}))
    out["hit_rate"] = sum(hits.values()) / asked if asked else 0.0
    out["hit_rate_by_tier"] = {t: n / asked if asked else 0.0 for t, n in hits.items()}
    ms = sum(s.get("mean_lookup_ms", 0.0) * s.get("lookups", 0) for s in stores)
    out["mean_lookup_ms"] = ms / lookups if lookups else 0.0
    out["home"] = home
    out["layout"] = stores[0]["layout"] if len(stores) == 1 else {}
    out["layouts"] = per_layout
    return out
