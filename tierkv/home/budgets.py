"""How a home's tier budgets are divided among the page layouts it holds: the memory tiers
(device, host) among the layouts in use, the disk tier among all of them. The rule is the
home's, so the daemon and a command that opens the home itself give a layout the same
share (:func:`command_limits`; before, a command opened each layout with the whole budget,
so two layouts written without a daemon could hold twice the disk budget between them).

The daemon (daemon/layouts.py) decides which layouts are in use: one is while a connection
is bound to it, and for ``layout_idle_s`` after its last one left. An idle layout's memory
share returns to the layouts in use (issue 34: three idle junk layouts held three quarters
of every tier for good); it keeps its disk share, because lowering a disk limit deletes
blocks, and a model's KV surviving its idle hours is what the disk tier is for. When no
layout is in use, nobody gains from a lowered share, so every open layout keeps an equal
part. A command uses the layout it opens (all of them, for ``Home.open``).

Limits change in two passes, every lowering before any raise, so the limits never add up to
more than a budget, not even between two stores' calls.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

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
            f"a page of layout {lid} is {layout.page_bytes} bytes; its share of the home's budgets "
            f"(the daemon's, when one serves it) would be {share.device_bytes} bytes of device tier and "
            f"{share.disk_bytes} of disk",
            hint="declare a smaller block_size, or give larger budgets (the daemon's --device-bytes/--disk-bytes, "
                 "TIERKV_DEVICE_BYTES/TIERKV_DISK_BYTES, or [store] in the config file)")


def command_limits(options: Mapping[str, Any], layout_ids: Iterable[str], opened: Iterable[str]) -> dict[str, TierLimits]:
    """Each layout's share when a command opens a home holding ``layout_ids`` (a new layout
    included) itself, the ``opened`` ones in use: the budgets are what ``options`` name
    (StoreConfig fields; its defaults where they name none), divided as the daemon with the
    same budgets divides them."""
    from ..config import StoreConfig

    def size(name: str) -> int:
        given = options.get(name)
        return int(given) if given is not None else int(getattr(StoreConfig, name))

    budget = Budget(size("device_bytes"), size("host_bytes"), size("disk_bytes"), 0, 0)
    return budget.plan(layout_ids, opened)


def limit_options(share: TierLimits) -> dict[str, int]:
    """A share as the StoreConfig fields that set a store's limits."""
    return {"device_limit_bytes": share.device_bytes, "host_limit_bytes": share.host_bytes,
            "disk_limit_bytes": share.disk_bytes}
