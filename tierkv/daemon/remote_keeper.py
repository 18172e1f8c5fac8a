"""The daemon's remote tier (cluster): each layout's store wrapped in a ClusterNode, and the
keeper thread that connects, reconnects and checks each remote tier, so that a master that
is absent or fails never stops the daemon (docs/cluster.md).

:class:`RemoteKeeper` is a part of :class:`~tierkv.daemon.server.Daemon`. It owns the
keeper thread and the settings of the remote tier (fixed for the daemon's life: a reload
refuses them, reload.py); the daemon hands it, at start, how to list the layouts served.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from ..store import Store
from .config import BIND_ENV, DaemonConfig

if TYPE_CHECKING:
    from ..cluster import ClusterNode
    from .layouts import LayoutEntry

log = logging.getLogger("tierkv.daemon.server")  # the daemon's log (operators and tests filter on it)
REMOTE_CHECK_S = 5.0  # while the remote tier is up, the keeper checks it this often


class RemoteKeeper:
    """Joins each layout's store to the cluster, and keeps its remote tier connected."""

    def __init__(self, config: DaemonConfig, backend_factory: Callable[[Any], Any] | None = None) -> None:
        """``backend_factory``: a stand-in for the Mooncake client (tests)."""
        self.config = config
        self._backend_factory = backend_factory
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def join_cluster(self, store: Store) -> ClusterNode:
        """Wrap ``store`` in a ClusterNode with the configured remote tier. Nothing remote
        happens here: the tier connects from the keeper thread (:meth:`start`), and while
        it cannot, the daemon serves from its local tiers."""
        from ..cluster import ClusterNode
        from ..cluster.remote import RemoteTier

        cfg = self.config
        # Before any Mooncake client exists: the transfer engine reads it once, at setup.
        os.environ[BIND_ENV] = cfg.resolved_remote_bind
        rcfg = cfg.remote_config()
        kw: dict[str, Any] = {} if self._backend_factory is None else {"backend_factory": self._backend_factory}
        remote = RemoteTier(rcfg, store.layout, **kw)
        log.info("remote tier: master %s, metadata %s, this node %s (bind %s), lends %d MiB, key prefix %r",
                 rcfg.master_address, rcfg.metadata_url, rcfg.local_hostname, cfg.resolved_remote_bind,
                 rcfg.global_segment_bytes >> 20, rcfg.key_prefix)
        return ClusterNode(store, remote, cfg.publish_policy())

    def start(self, entries: Callable[[], list[LayoutEntry]]) -> None:
        """Start the keeper thread over the layouts ``entries()`` lists (read each round: a
        layout opened later is kept too)."""
        self._thread = threading.Thread(target=self._keep, args=(entries,), name="tierkv-remote-keeper", daemon=True)
        self._thread.start()

    def _keep(self, entries: Callable[[], list[LayoutEntry]]) -> None:
        """Keeper thread: connect each layout's remote tier at start (or when the layout
        opens), reconnect it while it is down (as often as its backoff allows) and check it
        now and then while it is up, so that ``stats`` tells its state even when no request
        has touched it. Each time a tier comes up its node republishes the named prefixes: a
        restarted master has lost them."""
        probe = [b"\0" * 32]
        last_check: dict[str, float] = {}
        ups_seen: dict[str, int] = {}
        wait = 0.0
        while not self._stop.wait(wait):
            wait = 0.25
            for entry in entries():
                node, lid = entry.store, entry.layout_id
                if isinstance(node, Store) or node.remote is None:
                    continue  # a layout served without the remote tier
                remote = node.remote
                try:
                    if not remote.up:
                        if remote.available:
                            remote.exists(probe)
                    elif time.monotonic() - last_check.get(lid, 0.0) >= REMOTE_CHECK_S:
                        last_check[lid] = time.monotonic()
                        remote.exists(probe)
                    ups = remote.counters["connects"] + remote.counters["reconnects"]
                    if remote.up and ups != ups_seen.get(lid, 0):
                        ups_seen[lid] = ups
                        log.info("remote tier of %s up: republished %d blocks of named prefixes", lid, node.republish())
                except Exception:  # noqa: BLE001 - the keeper must outlive any surprise
                    log.exception("remote tier keeper (%s)", lid)

    def stop(self) -> None:
        """Stop the keeper thread; waits for a connect in progress to give up."""
        self._stop.set()
        if self._thread is not None:
            rcfg = self.config.remote_config()
            self._thread.join(rcfg.setup_timeout_s + rcfg.op_timeout_s + 5 if rcfg else 5)
            self._thread = None
