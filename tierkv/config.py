"""Store configuration: one frozen dataclass, validated when built.

Only the CLI reads files and environment variables; library code takes a StoreConfig.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .layout import PageLayout
from .core.policy import DEFAULT_POLICY
from .core.policy_spec import tier_policies

MiB = 1 << 20
GiB = 1 << 30
# The environment variables tierkv reads, all here (only the CLI and `tierkv serve` read them).
HOME_ENV = "TIERKV_HOME"  # the store home
SOCKET_ENV = "TIERKV_SOCKET"  # the daemon's socket
KEYS_ENV = "TIERKV_KEYS"  # the bundle-signing keyring


def check_sizes(config: object, *names: str) -> None:
    """Raise ValueError unless each attribute ``names`` of ``config`` is a byte count: a
    non-negative int (a bool is refused). The capacity check of StoreConfig and the vLLM
    connector's config; the daemon's sections (daemon/config/settings.py) name a setting by
    its key (``staging.region_bytes``), the same check."""
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")


@dataclass(frozen=True)
class StoreConfig:
    """Where a store lives and how big each tier is (capacities in bytes).

    ``device`` is ``"cuda:N"`` or ``"cpu"``; ``None`` picks ``cuda:0`` when CUDA is
    available, else the CPU (so CPU-only machines run the same code paths).
    ``write_through=True`` makes every put durable on the disk tier before it returns;
    with ``False`` blocks reach disk when evicted from host memory or at ``close()``.
    ``verify_on_open`` is ``"size"`` (check every indexed page's segment exists and is long
    enough) or ``"full"`` (also re-checksum every page; reads every byte of the disk tier).
    Every read from disk is checksummed regardless.
    """

    home: Path
    layout: PageLayout
    device: str | None = None
    device_bytes: int = 256 * MiB
    host_bytes: int = 1 * GiB
    disk_bytes: int = 16 * GiB
    segment_pages: int = 256
    write_through: bool = True
    verify_on_open: str = "size"
    index_map_bytes: int = 1 * GiB
    shm_dir: Path | None = None
    odirect: bool = True
    # Disk tier reads: O_DIRECT (where the file system accepts it), or buffered (page cache
    # and kernel readahead; each run dropped from the cache once read, so the memory tiers
    # stay the only copy). On the virtio disk of docs/performance-history.md plain sequential reads
    # were 1.2-1.3x faster buffered, but a restore was not (0.87-1.03x, more variable).
    direct_reads: bool = True
    fsync: bool = True
    prefetch_workers: int = 2
    # Fault the whole shared-memory tiers in on a background thread after open (never at
    # open). Worth it where the process has idle time before its first requests: the daemon,
    # opened ahead of its clients, turns it on. Off (the default): nothing is faulted in at
    # open, so nothing competes with the first requests (in a vLLM engine with an embedded
    # store on 2 cores, populating 768 MiB right after start made the first hit after a
    # restart 196-228 ms instead of 87-97 ms, docs/performance-history.md); once a tier is
    # used, the same thread faults it in only 64 MiB ahead of its use (tiers/memory.py).
    populate_memory: bool = False
    # Fault only the device tier's first 64 MiB in behind the open, where the first
    # promotion lands: for a process whose first use after open comes seconds later and is a
    # read from disk (the vLLM connector's embedded store, opened when the engine starts).
    # Without it that first hit after an engine restart read into fresh pages, and the
    # populator started by the read faulted the same and the next 64 MiB on the engine's
    # cores during the reads and the forward pass (docs/performance-history.md, 2026-12-07).
    # Off by default: a restore right after open shared its cores with it (scripts/ab.py
    # restore 0.82 of the base, null 0.94).
    populate_device_ahead: bool = False
    # After open, read back into the device tier (on a thread, into free slots only) what it
    # held at the last close, or the newest blocks after a crash (tierkv/core/warm_start.py):
    # for a process that restarts and takes seconds before its first request (a vLLM engine,
    # the daemon). Off by default: a restore right after open would share the disk with it.
    warm_at_open: bool = False
    # tierkv/core/policy.py: "arc" (default), "leader", "lru", "lru2" or "mix" for every tier,
    # or per tier (tierkv/core/policy_spec.py): "leader,disk=arc"
    eviction_policy: str = DEFAULT_POLICY
    # tierkv/codec.py: how the host and disk tiers store pages, "none" (exact) or "int8";
    # fixed when the home is created. None: the home's codec ("none" for a new home).
    page_codec: str | None = None
    # What each tier may use at open (None: all of its *_bytes); Store.set_tier_limits moves
    # it. A daemon maps its layouts' tiers at the whole budget and splits it as limits.
    device_limit_bytes: int | None = None
    host_limit_bytes: int | None = None
    disk_limit_bytes: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home))
        if not isinstance(self.layout, PageLayout):
            raise ValueError("layout must be a PageLayout")
        slot = self.layout.slot_bytes
        check_sizes(self, "device_bytes", "host_bytes", "disk_bytes", "index_map_bytes")
        if self.device_bytes < self.layout.page_bytes:
            raise ValueError(
                f"device_bytes={self.device_bytes} is below one page ({self.layout.page_bytes} bytes); "
                "the device tier must hold at least one page"
            )
        for name in ("host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if 0 < value < slot:
                raise ValueError(f"{name}={value} is below one page slot ({slot} bytes); use 0 to disable the tier")
        for name in ("device_limit_bytes", "host_limit_bytes", "disk_limit_bytes"):
            if getattr(self, name) is not None:
                check_sizes(self, name)
        if self.segment_pages <= 0:
            raise ValueError("segment_pages must be positive")
        if self.verify_on_open not in ("size", "full"):
            raise ValueError("verify_on_open must be 'size' or 'full'")
        if self.index_map_bytes < 1 * MiB:
            raise ValueError("index_map_bytes must be at least 1 MiB")
        tier_policies(self.eviction_policy)  # ValueError naming what is wrong
        if self.page_codec is not None:
            from .codec import PageCodec

            PageCodec(self.page_codec, self.layout)  # raises ValueError for an unknown codec or layout
        if self.device is not None and not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")

    def resolved_device(self) -> str:
        if self.device is not None:
            return self.device
        import torch

        return "cuda:0" if torch.cuda.is_available() else "cpu"


def default_home() -> Path:
    """Per-user data directory; the CLI uses $TIERKV_HOME first."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(base) / "tierkv"
