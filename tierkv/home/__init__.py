"""A home: the directory that holds a store per page layout, and the one object that
serves them all (issue #32).

- :mod:`.lock`: who owns a home (one process at a time, ``HOME/LOCK``);
- :mod:`.directory`: where each layout's store lives in it, and how one is removed;
- :mod:`.home`: :class:`Home`, every store of a home as one :class:`~tierkv.api.StoreAPI`
  (chains and manifests found where they are, invalidate/verify/stats over all of them);
  what ``--home`` commands open, and what the daemon's cross-layout operations run on;
- :mod:`.stats`: the stats of several layouts merged into one answer.

``Home`` loads on first use: the store imports this package's lock, and ``Home`` imports
the store.
"""
from __future__ import annotations

from typing import Any

from .directory import LAYOUTS_DIR, find_layouts, layout_id, remove_store_files, store_home
from .lock import HomeLock, LentLock, peek_layout

__all__ = ["LAYOUTS_DIR", "Home", "HomeLock", "LentLock", "find_layouts", "layout_id", "peek_layout",
           "remove_store_files", "store_home"]


def __getattr__(name: str) -> Any:
    if name == "Home":
        from .home import Home

        return Home
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
