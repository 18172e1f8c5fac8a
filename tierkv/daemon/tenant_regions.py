"""The memory a tenant maps (issue #34, item 1): under ``namespace_per_uid`` a client of
another uid gets no descriptor of the daemon's tiers nor of the shared staging region, only
two regions of its own connection:

* a *read window*: the pages of each lease it takes are copied there (from the device tier,
  where a lease's blocks are) and its lease reply names those slots, so what it can read is
  what it leased, and nothing it writes there reaches a tier;
* a *staging region*: the pages it puts, copied out by the commit (as from the shared one),
  so scribbling on them can only spoil its own puts.

Both are ``client_staging_bytes`` each and end with the connection. A lease longer than the
free read window is cut to it (a shorter hit: the client leases the rest in further
windows, as tierkv's restore does). The daemon's own uid keeps the zero-copy path: it maps
the tiers themselves (it could read the daemon's memory anyway).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..layout import PageLayout
from ..tiers.base import SlotAllocator
from .leases import StagingSlots
from .regions import create_staging


class TenantRegions:
    """One tenant connection's read window and staging region (owned by the connection;
    :meth:`close` when it ends)."""

    def __init__(self, directory: Path, layout: PageLayout, nbytes: int) -> None:
        self.read_region, self.read_pool = create_staging(directory, layout, nbytes)
        self.read_slots = SlotAllocator(self.read_pool.shape[0])
        self.staging_region, self.staging_pool = create_staging(directory, layout, nbytes)
        self.staging = StagingSlots(self.staging_pool.shape[0], self.staging_pool.shape[0])
        self.layout = layout

    @property
    def read_free(self) -> int:
        return self.read_slots.num_free

    def hello_fields(self, fds: list[int]) -> dict[str, Any]:
        """HELLO's region fields, as the shared ones are described: the read window in the
        device pool's place (the client reads leased pages from it), no host pool."""
        page = self.layout.page_bytes
        fds.append(self.read_region.fd)
        read = {"fd": len(fds) - 1, "nbytes": self.read_region.nbytes, "stride_bytes": page,
                "slots": self.read_pool.shape[0]}
        fds.append(self.staging_region.fd)
        staging = {"fd": len(fds) - 1, "nbytes": self.staging_region.nbytes, "stride_bytes": page,
                   "slots": self.staging_pool.shape[0]}
        return {"device": read, "host": None, "device_ipc": None, "staging": staging,
                "stage_quota": self.staging.quota}

    def copy_in(self, pool: torch.Tensor, slots: tuple[int, ...] | list[int]) -> list[int]:
        """Copy the pages at ``slots`` of ``pool`` (the device tier, CPU or CUDA) into free
        slots of the read window; returns those slots. The caller checked the room."""
        mine = [self.read_slots.alloc() for _ in slots]
        assert all(s is not None for s in mine), "read window smaller than the lease it was cut to"
        src = pool.index_select(0, torch.as_tensor(list(slots), dtype=torch.long, device=pool.device))
        self.read_pool.index_copy_(0, torch.as_tensor(mine, dtype=torch.long), src.cpu())
        return mine  # type: ignore[return-value]

    def free(self, slots: list[int]) -> None:
        for s in slots:
            self.read_slots.free(s)

    def close(self) -> None:
        empty = torch.empty((0, *self.layout.shape), dtype=self.layout.torch_dtype)
        self.read_pool = self.staging_pool = empty  # no view may keep a closed mapping exported
        for region in (self.read_region, self.staging_region):
            region.close()

    def check_integrity(self) -> None:
        self.read_slots.check_integrity()
        self.staging.check_integrity()
