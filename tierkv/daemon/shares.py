"""How the daemon-wide tier budgets are divided among the open layouts (layouts.py): the
memory tiers (device, host) among the layouts in use, the disk tier among all of them.

A layout is in use while a connection is bound to it, and for ``layout_idle_s`` after its
last one left (the daemon's loop decides, server.py). An idle layout's memory share returns
to the layouts in use (issue 34: three idle junk layouts held three quarters of every tier
for good); it keeps its disk share, because lowering a disk limit deletes blocks, and a
model's KV surviving its idle hours is what the disk tier is for. When no layout is in use,
nobody gains from a lowered share, so every open layout keeps an equal part.

Limits change in two passes, every lowering before any raise, so the limits never add up to
more than a budget, not even between two stores' calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

from ..errors import CapacityError
from ..layout import PageLayout


@dataclass(frozen=True)
class TierLimits:
    """What one layout's tiers may use now (bytes): its share of the budgets."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int

    def lower_of(self, other: "TierLimits") -> "TierLimits":
        return TierLimits(min(self.device_bytes, other.device_bytes), min(self.host_bytes, other.host_bytes),
                          min(self.disk_bytes, other.disk_bytes))


@dataclass(frozen=True)
class Budget:
    """The daemon-wide tier budgets the open layouts share, and the staging each layout
    gets (bytes)."""

    device_bytes: int
    host_bytes: int
    disk_bytes: int
    staging_bytes: int  # per layout
    client_staging_bytes: int  # per connection

    def share(self, n: int) -> TierLimits:
        """What each of ``n`` layouts, all in use, may use."""
        n = max(1, n)
        return TierLimits(self.device_bytes // n, self.host_bytes // n, self.disk_bytes // n)

    def plan(self, open_ids: Iterable[str], in_use: Iterable[str]) -> dict[str, TierLimits]:
        """Each open layout's limits: memory split among those ``in_use`` (all of them when
        none is), disk among all; an idle layout's memory limits are 0."""
        ids = list(open_ids)
        active = [i for i in ids if i in set(in_use)] or ids
        memory, disk = self.share(len(active)), self.share(len(ids))
        return {i: TierLimits(memory.device_bytes if i in active else 0, memory.host_bytes if i in active else 0,
                              disk.disk_bytes) for i in ids}


def apply_in_order(current: Mapping[str, TierLimits], target: Mapping[str, TierLimits],
                   set_limits: Callable[[str, TierLimits], None]) -> None:
    """Move every layout from ``current`` to ``target`` limits: first each one down to the
    lower of both, then up to its target (the sums never exceed a budget meanwhile)."""
    for lid, want in target.items():
        low = want.lower_of(current[lid])
        if low != current[lid]:
            set_limits(lid, low)
    for lid, want in target.items():
        if want != want.lower_of(current[lid]):
            set_limits(lid, want)


def check_fits(lid: str, layout: PageLayout, share: TierLimits) -> None:
    """CapacityError when the share layout ``lid`` would get holds no page of it (device) or
    no slot (disk, when there is one): a store that can hold nothing is refused, not built."""
    if share.device_bytes < layout.page_bytes or 0 < share.disk_bytes < layout.slot_bytes:
        raise CapacityError(
            f"a page of layout {lid} is {layout.page_bytes} bytes; its share of the daemon's "
            f"budgets would be {share.device_bytes} bytes of device tier and {share.disk_bytes} of disk",
            hint="declare a smaller block_size, or restart the daemon with larger --device-bytes/--disk-bytes")
