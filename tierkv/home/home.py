"""Every store of a home as one :class:`~tierkv.api.StoreAPI`: what the ``--home``
commands open, so that they reach every page layout of a home a daemon made
(``HOME/layouts/<id>/``), and what the daemon's cross-layout operations run on (a view over
the stores it serves, the connection's own first: tierkv/daemon/operation_handlers.py), so that
``--home`` and ``--socket`` answer by the same rules.

Chains and manifests are found in whichever store holds them (a manifest naming its
``layout`` is saved in that layout's store), ``invalidate``, ``verify``,
``check_integrity`` and ``stats`` cover every store, and ``stats`` has the daemon's shape
(sums, with ``layouts``: each store's own figures). Like a daemon client that declared no
layout, it stores and reads pages only when the home holds one layout. ``tierkv gc`` runs
its rule (tierkv/home/gc.py) on a Home whether through ``--home`` or the daemon's GC, so both see
every tenant's blocks and manifests (issue #34, item 5).

Rejected: a command looping over the stores itself (each command would re-implement the
daemon's rules, and ``--home`` and ``--socket`` would drift apart again); opening only the
layout a command names (stats, ls, gc and verify name none).
"""
from __future__ import annotations

from concurrent.futures import Future
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..api import StoreAPI
from ..core.blocks import Priority
from ..errors import ConfigError, NotFoundError
from ..identity import Scope
from ..layout import PageLayout
from ..results import (
    ChainTokens, InvalidateResult, LookupResult, PutResult, RemoveLayoutResult, Residency, StoreStats,
    VerifyResult, namespace_page,
)
from ..lease import Lease
from ..core.store import Store
from .budgets import check_fits, command_limits, limit_options
from .directory import LAYOUTS_DIR, find_layouts, layout_id, remove_store_files
from .lock import HomeLock
from .stats import merge_stats


class Home(StoreAPI):
    """The stores of one home (root first). Build with :meth:`open`; the daemon builds a
    view over the stores it serves (``own``: the connection's, which comes first and takes
    a manifest that names no layout). A view does not own its stores: do not close it."""

    def __init__(self, home: Path, stores: Sequence[StoreAPI], own: StoreAPI | None = None) -> None:
        self.home = home
        self.stores = list(stores)
        self.own = own
        self.layouts = tuple(layout_id(s.layout) for s in self.stores)
        self.layout: PageLayout | None = self.stores[0].layout if len(self.stores) == 1 else None

    @classmethod
    def open(cls, home: Path, **options: Any) -> "Home":
        """Open every store ``home`` holds (``options``: StoreConfig fields for each). Raises
        NotFoundError when it holds none, StoreLockedError/DaemonOwnsHomeError when another
        process has it."""
        found = find_layouts(home)
        # A home whose every layout was removed (`tierkv layouts rm`) keeps its layouts/
        # directory and opens empty, as a daemon serving no layout answers; a directory
        # that never held a store is a mistyped --home.
        if not found and not (home / LAYOUTS_DIR).is_dir():
            raise NotFoundError(f"{home} holds no tierkv store", hint="materialise a prefix first, or check --home")
        # Each layout's share of the budgets, as a daemon with the same budgets and no
        # layout in use gives it (budgets.py): the budgets are the home's, not each store's.
        ids = [layout_id(layout) for _, layout in found]
        shares = command_limits(options, ids, ids)
        stores: list[Store] = []
        try:
            for (h, layout), lid in zip(found, ids):
                check_fits(lid, layout, shares[lid])
                stores.append(Store(_config(h, layout, {**options, **limit_options(shares[lid])})))
        except BaseException:
            for s in stores:
                s.close()
            raise
        return cls(home, stores)

    def store_for(self, layout: PageLayout) -> StoreAPI:
        """The store of ``layout``; ConfigError when the home holds none."""
        for s in self.stores:
            if s.layout == layout:
                return s
        raise ConfigError(f"{self.home} holds no store of layout {layout_id(layout)} (it holds {', '.join(self.layouts)})")

    # ---- the data path: only with one layout (as a daemon client that declared none) --------
    def _only(self) -> StoreAPI:
        if self.layout is None:
            raise ConfigError(f"{self.home} holds {len(self.stores)} page layouts ({', '.join(self.layouts)}); "
                              "storing or reading pages needs one", hint="open the layout's store with tierkv.open")
        return self.stores[0]

    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
               block_extra: Sequence[Sequence[str | bytes]] | None = None) -> LookupResult:
        return self._only().lookup(tokens, scope, block_extra)

    def acquire(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None,
                start_block: int = 0, promote: bool = True) -> Lease:
        return self._only().acquire(tokens, scope, block_extra, max_blocks, start_block, promote)

    def release(self, lease: Lease) -> None:
        self._only().release(lease)

    def prefetch(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                 block_extra: Sequence[Sequence[str | bytes]] | None = None) -> Future[int]:
        return self._only().prefetch(tokens, scope, block_extra)

    def block_keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, n_blocks: int | None = None,
                   block_extra: Sequence[Sequence[str | bytes]] | None = None) -> list[bytes]:
        return self._only().block_keys(tokens, scope, n_blocks, block_extra)

    def put(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, pages: torch.Tensor, scope: Scope, *,
            start_block: int = 0, block_extra: Sequence[Sequence[str | bytes]] | None = None,
            priority: Priority = Priority.NORMAL) -> PutResult:
        return self._only().put(tokens, pages, scope, start_block=start_block, block_extra=block_extra,
                                priority=priority)

    def set_priority(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, priority: Priority) -> int:
        return self._only().set_priority(tokens, scope, priority)

    # ---- chains: in the store that holds them (keys are unique across layouts) ------------
    def find_chain(self, last_key: bytes) -> tuple[StoreAPI, ChainTokens]:
        """The store that holds the chain ending at ``last_key`` (keys are unique across
        layouts: the model version names the layout), and its tokens. NotFoundError when
        none does."""
        for s in self.stores:
            try:
                return s, s.chain_tokens(last_key)
            except NotFoundError:
                continue
        raise NotFoundError(f"block {last_key.hex()[:16]} is not stored")

    def chain_tokens(self, last_key: bytes) -> ChainTokens:
        return self.find_chain(last_key)[1]

    def chain_residency(self, last_key: bytes) -> Residency:
        try:
            s, _ = self.find_chain(last_key)
        except NotFoundError:
            return Residency()
        return s.chain_residency(last_key)

    def set_priority_from(self, last_key: bytes, priority: Priority) -> int:
        try:
            s, _ = self.find_chain(last_key)
        except NotFoundError:
            return 0
        return s.set_priority_from(last_key, priority)

    # ---- manifests -------------------------------------------------------------------------
    def manifest_store(self, manifest: dict[str, Any]) -> StoreAPI:
        """Where a manifest is saved: the store of the layout it names (``layout``, as
        materialize writes), else the view's own store, else the only one."""
        raw = manifest.get("layout")
        if isinstance(raw, dict):
            try:
                return self.store_for(PageLayout.from_dict(raw))
            except (ConfigError, ValueError, TypeError, KeyError):
                pass
        if self.own is not None:
            return self.own
        if self.layout is None:
            raise ConfigError(f"the manifest names no layout that {self.home} holds, and it holds several",
                              hint="give the manifest its 'layout' (as materialize writes it)")
        return self.stores[0]

    def save_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        self.manifest_store(manifest).save_manifest(name, manifest)

    def manifests(self) -> dict[str, tuple[StoreAPI, dict[str, Any]]]:
        """Name -> (store, manifest) over every store; the first store's wins a name two
        stores hold (the root's here, the connection's own in the daemon)."""
        out: dict[str, tuple[StoreAPI, dict[str, Any]]] = {}
        for s in reversed(self.stores):
            out.update({k: (s, v) for k, v in s.list_manifests().items()})
        return out

    def get_manifest(self, name: str) -> dict[str, Any]:
        every = self.manifests()
        if name not in every:
            raise NotFoundError(f"no prefix named {name!r} (known: {', '.join(sorted(every)) or 'none'})")
        return every[name][1]

    def list_manifests(self) -> dict[str, dict[str, Any]]:
        return {k: v for k, (_, v) in self.manifests().items()}

    def delete_manifest(self, name: str) -> bool:
        return any([s.delete_manifest(name) for s in self.stores])  # a list: every store, not the first

    # ---- across every store ----------------------------------------------------------------
    def invalidate(self, *, model_version: str | None = None, namespace: str | None = None,
                   dry_run: bool = False) -> InvalidateResult:
        if model_version is None and namespace is None:
            raise ValueError("invalidate needs model_version or namespace")
        rs = [s.invalidate(model_version=model_version, namespace=namespace, dry_run=dry_run) for s in self.stores]
        return InvalidateResult(sum(r.removed_blocks for r in rs), sum(r.freed_bytes for r in rs), dry_run)

    def verify(self, repair: bool = False) -> VerifyResult:
        rs = [s.verify(repair) for s in self.stores]
        return VerifyResult(sum(r.checked for r in rs), tuple(k for r in rs for k in r.corrupt), repair,
                            tuple(k for r in rs for k in r.unreadable))

    def stats(self, namespace_limit: int | None = None, namespace_after: str | None = None) -> StoreStats:
        """Every store's stats summed, with ``layouts`` (layout id -> that store's figures),
        the namespaces paged as :meth:`tierkv.api.StoreAPI.stats` says (each layout's
        figures carry the namespaces of the page only), as the daemon answers."""
        namespace_page({}, namespace_limit, namespace_after)  # ValueError on a bad limit, as the Store's
        merged = self.merged_stats()
        merged["namespaces"], after = namespace_page(merged["namespaces"], namespace_limit, namespace_after)
        if after is not None:
            merged["namespaces_next"] = after
        merged["layouts"] = {lid: {**ls, "namespaces": {ns: n for ns, n in ls["namespaces"].items()
                                                        if ns in merged["namespaces"]}}
                             for lid, ls in merged["layouts"].items()}
        return StoreStats.from_dict(merged)

    def merged_stats(self) -> dict[str, Any]:
        """Every store's stats summed (the JSON shape of StoreStats), with ``layouts``: the
        same figures per layout id, every namespace (unpaged)."""
        return merge_stats({lid: s.stats().as_dict() for lid, s in zip(self.layouts, self.stores)}, str(self.home))

    def remove_layout(self, lid: str) -> RemoveLayoutResult:
        """Close the store of layout ``lid`` and delete its files, as the daemon's
        REMOVE_LAYOUT does (layouts.remove_store_files). This process holds every store of
        the home, so no one else uses it. NotFoundError when the home holds no such layout."""
        if lid not in self.layouts:
            raise NotFoundError(f"{self.home} holds no layout {lid} (it holds {', '.join(self.layouts)})",
                                hint="list them with `tierkv layouts`")
        i = self.layouts.index(lid)
        store = self.stores[i]
        if not isinstance(store, Store):
            raise ConfigError(f"layout {lid} is served by a daemon", hint="tierkv layouts rm --socket")
        self.stores.pop(i)
        self.layouts = self.layouts[:i] + self.layouts[i + 1:]
        stats = store.stats()
        store_home = Path(store.config.home)
        store.close()
        # The home's LOCK while the files go (the root store held it until its close; a
        # layout below the root keeps the root store open, which holds it).
        lock = HomeLock(store_home, None)
        try:
            remove_store_files(self.home, store_home)
        finally:
            lock.release()
        return RemoveLayoutResult(lid, stats.blocks, stats.tiers["disk"].used_bytes)

    def check_integrity(self) -> None:
        for s in self.stores:
            s.check_integrity()

    def close(self) -> None:
        """Close every store (each even when another fails)."""
        errors: list[BaseException] = []
        for s in self.stores:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001 - the others must still be closed
                errors.append(e)
        if errors:
            raise errors[0]

    def __enter__(self) -> "Home":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _config(home: Path, layout: PageLayout, options: dict[str, Any]) -> Any:
    from ..config import StoreConfig

    return StoreConfig(home=home, layout=layout, **options)
