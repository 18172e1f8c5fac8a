"""tierkv: a tiered KV-cache store keyed by model identity.

    store = tierkv.open(home, layout)            # embedded, in-process
    with store.acquire(tokens, scope) as lease:   # longest cached prefix, on the device tier
        ...
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import native

native.install_guard()  # before any compiled module is imported: stale ones must not load

from .blocks import Priority  # noqa: E402  (after the guard, as are the imports below)
from .config import StoreConfig  # noqa: E402
from .errors import TierKVError  # noqa: E402
from .identity import Scope, block_keys  # noqa: E402
from .layout import PageLayout  # noqa: E402
from .results import InvalidateResult, Lease, LookupResult, PutResult, VerifyResult  # noqa: E402
from .store import Store  # noqa: E402

if TYPE_CHECKING:
    from .daemon.client import Client

__version__ = "0.1.0"


def open(home: str | os.PathLike[str], layout: PageLayout | None = None, **options: Any) -> Store:  # noqa: A001
    """Open (creating if needed) the store at ``home`` for pages of ``layout``.

    ``layout=None`` opens an existing home with the layout it was created with (operations
    tools do this). ``options`` are :class:`StoreConfig` fields (``device``, ``device_bytes``,
    ``host_bytes``, ``disk_bytes``, ``write_through``, ``page_codec``: ``"int8"`` keeps a new
    home's host and disk pages as int8, see tierkv/codec.py ...). Raises LayoutMismatchError when
    the home holds another layout (CodecMismatchError: another page codec), StoreLockedError when another process has it open,
    NotFoundError when ``layout`` is None and the home holds no store.
    """
    if layout is None:
        layout = home_layout(home)
    return Store(StoreConfig(home=Path(home), layout=layout, **options))


def home_layout(home: str | os.PathLike[str]) -> PageLayout:
    """The page layout an existing home was created with (read without opening the store).
    Raises NotFoundError when ``home`` holds no store."""
    from .errors import NotFoundError
    from .home.lock import peek_layout

    layout = peek_layout(Path(home))
    if layout is None:
        raise NotFoundError(f"{home} holds no tierkv store", hint="materialise a prefix first, or check --home")
    return layout


def connect(socket_path: str | os.PathLike[str], layout: PageLayout | None = None, **options: Any) -> Client:
    """A client of a running ``tierkv serve`` daemon, with the same API as :class:`Store`.

    ``layout`` declares the page layout of the pages this client stores and reads: the
    daemon opens (creating on first use) a store for it, so one daemon serves every model
    on the host. Without it the client gets the daemon's layout when it serves exactly one,
    else only operations (manifests, stats, invalidate, verify, gc). ``options``: ``timeout``,
    ``connect_timeout``, ``daemon_uid``."""
    from .daemon.client import Client

    return Client(Path(socket_path), layout=layout, **options)


__all__ = [
    "InvalidateResult", "Lease", "LookupResult", "PageLayout", "Priority", "PutResult", "Scope", "Store",
    "StoreConfig", "TierKVError", "VerifyResult", "block_keys", "connect", "home_layout", "open",
]
