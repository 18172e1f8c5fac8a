"""tierkv: a tiered KV-cache store keyed by model identity.

    store = tierkv.open(home, layout)            # embedded, in-process
    with store.acquire(tokens, scope) as lease:   # longest cached prefix, on the device tier
        ...
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .blocks import Priority
from .config import StoreConfig
from .errors import TierKVError
from .identity import Scope, block_keys
from .layout import PageLayout
from .results import InvalidateResult, Lease, LookupResult, PutResult, VerifyResult
from .store import Store

__version__ = "0.1.0"


def open(home: str | os.PathLike[str], layout: PageLayout, **options: Any) -> Store:  # noqa: A001
    """Open (creating if needed) the store at ``home`` for pages of ``layout``.

    ``options`` are :class:`StoreConfig` fields (``device``, ``device_bytes``, ``host_bytes``,
    ``disk_bytes``, ``write_through``, ...). Raises LayoutMismatchError when the home holds
    another layout, StoreLockedError when another process has it open.
    """
    return Store(StoreConfig(home=Path(home), layout=layout, **options))


def connect(socket_path: str | os.PathLike[str], **options: Any) -> Any:
    """A client of a running ``tierkv serve`` daemon, with the same API as :class:`Store`."""
    from .daemon.client import Client

    return Client(Path(socket_path), **options)


__all__ = [
    "InvalidateResult", "Lease", "LookupResult", "PageLayout", "Priority", "PutResult", "Scope", "Store",
    "StoreConfig", "TierKVError", "VerifyResult", "block_keys", "connect", "open",
]
