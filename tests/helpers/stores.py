"""Opening real stores with small tiers for the main-job tests."""
from __future__ import annotations

from pathlib import Path


def open_store(home: Path, layout, **options):
    """tierkv.open with a CPU-sized device tier, 64 MiB host and 256 MiB disk."""
    import tierkv

    return tierkv.open(home, layout, **{"device_bytes": 64 << 20, "host_bytes": 64 << 20,
                                        "disk_bytes": 256 << 20, **options})
