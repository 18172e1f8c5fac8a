"""Shared-memory regions the daemon creates besides the store's tiers (staging slots for
pages clients produce). Regions left by killed processes are reaped by
:func:`tierkv.tiers.shm.reap_stale_regions`, which every store open runs.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..layout import PageLayout
from ..tiers.shm import SharedRegion

def create_staging(directory: Path, layout: PageLayout, nbytes: int) -> tuple[SharedRegion, torch.Tensor]:
    """The staging region (at least one page) and its pool view ``[slots, *layout.shape]``
    (packed: stride = page_bytes)."""
    slots = max(1, nbytes // layout.page_bytes)
    region = SharedRegion.create(directory, "tierkv-staging", slots * layout.page_bytes)
    assert region.bytes is not None
    pool = region.bytes.view(layout.torch_dtype).view(slots, *layout.shape)
    return region, pool
