"""Shared-memory regions the daemon creates besides the store's tiers, and cleanup of the
ones a killed process left behind.

A region file is unlinked by its creator at close; a process killed with SIGKILL cannot do
that, and its tiers (often gigabytes of /dev/shm) would stay until reboot. At start the
daemon removes region files whose creating pid (in the name) no longer exists. Only files
of this user and of tierkv's naming pattern are touched; a file whose pid was reused by a
live process is left alone (a leak, never a wrong delete of a live region).
"""
from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import torch

from ..layout import PageLayout
from ..tiers.shm import SharedRegion

log = logging.getLogger(__name__)
REGION_RE = re.compile(r"^tierkv-(device|host|staging)-(\d+)-[0-9a-f]{8}$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_regions(directory: Path) -> int:
    """Delete region files in ``directory`` left by dead processes; returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for e in entries:
        match = REGION_RE.match(e.name)
        if not match or not e.is_file(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            os.unlink(e.path)
            removed += 1
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d shared-memory files of dead processes from %s", removed, directory)
    return removed


def create_staging(directory: Path, layout: PageLayout, nbytes: int) -> tuple[SharedRegion, torch.Tensor]:
    """The staging region (at least one page) and its pool view ``[slots, *layout.shape]``
    (packed: stride = page_bytes)."""
    slots = max(1, nbytes // layout.page_bytes)
    region = SharedRegion.create(directory, "tierkv-staging", slots * layout.page_bytes)
    assert region.bytes is not None
    pool = region.bytes.view(layout.torch_dtype).view(slots, *layout.shape)
    return region, pool
