"""The directory of a home: where each page layout's store lives in it, and how one goes.

    HOME/LOCK, index/, segments/    the first layout's store (so ``tierkv.open(HOME)`` and
                                    every ``--home`` command work on a one-model home)
    HOME/layouts/<layout-id>/       each further layout's: its own LOCK, index/, segments/
    .../CREATOR                     beside a store a daemon made for another uid's HELLO

These rules are the home's, not the daemon's: ``--home`` commands, bundles, the cluster
router and the daemon all find stores through them.
"""
from __future__ import annotations

import logging
import os
import shutil
import threading
from pathlib import Path

from ..layout import PageLayout
from .lock import peek_layout

log = logging.getLogger(__name__)

LAYOUTS_DIR = "layouts"
CREATOR = "CREATOR"  # beside a store made for another uid's HELLO: that uid (quotas.py, layouts_per_uid)


def read_creator(store_home: Path) -> int | None:
    """The uid whose HELLO made the store at ``store_home``, or None (the daemon's own)."""
    try:
        return int((store_home / CREATOR).read_text())
    except (OSError, ValueError):
        return None


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


def remove_store_files(home: Path, store_home: Path) -> None:
    """Delete the store at ``store_home`` (closed, its LOCK held by the caller or by no one):
    ``HOME/layouts/<id>`` whole, or the root's index/ and segments/ (the root keeps LOCK and
    layouts/). Each is first renamed to a ``.removed-*`` name in one step, the index first,
    so at every moment the home holds the store or not, never half of it; the renamed files
    are deleted after (a crash leaves them to the next removal, which deletes them)."""
    trash = home / f".removed-{os.getpid()}-{threading.get_ident()}"
    trash.mkdir(exist_ok=True)
    if store_home == home:
        for part in ("index", "segments", CREATOR):  # the index first: without it the root holds no store
            if (home / part).exists():
                os.rename(home / part, trash / part)
    else:
        os.rename(store_home, trash / store_home.name)
    for old in home.glob(".removed-*"):
        shutil.rmtree(old, ignore_errors=True)


def store_home(home: Path, layout: PageLayout) -> Path:
    """Where the store of ``layout`` lives in ``home``: where it is; else the root when the
    root holds no store yet; else ``HOME/layouts/<id>`` (as a daemon would create it)."""
    found = find_layouts(home)
    for h, lo in found:
        if lo == layout:
            return h
    if not any(h == home for h, _ in found):
        return home
    return home / LAYOUTS_DIR / layout_id(layout)
