"""The daemon's remote tier (cluster): each layout's store wrapped in a ClusterNode, and the
keeper thread that connects, reconnects and checks each remote tier, so that a master that
is absent or fails never stops the daemon (docs/cluster.md).
:class:`~tierkv.daemon.server.Daemon` inherits these methods and owns the state they use
(``config``, ``layouts``, ``_remote_factory``, ``_remote_stop``, ``_remote_keeper``). Split out
of server.py.
"""
from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

from .config import BIND_ENV

if TYPE_CHECKING:
    from ..store import Store

log = logging.getLogger("tierkv.daemon.server")  # the daemon's log, as before the split
REMOTE_CHECK_S = 5.0  # while the remote tier is up, the keeper checks it this often


class RemoteKeeper:
    """The remote-tier methods of :class:`~tierkv.daemon.server.Daemon`."""

    def _join_cluster(self, store: Store) -> Any:
        """Wrap ``store`` in a ClusterNode with the configured remote tier. Nothing remote
        happens here: the tier connects from the keeper thread (:meth:`_keep_remote`), and
        while it cannot, the daemon serves from its local tiers."""
        from ..cluster import ClusterNode
        from ..cluster.remote import RemoteTier

        cfg = self.config
        # Before any Mooncake client exists: the transfer engine reads it once, at setup.
        os.environ[BIND_ENV] = cfg.resolved_remote_bind
        rcfg = cfg.remote_config()
        kw = {} if self._remote_factory is None else {"backend_factory": self._remote_factory}
        remote = RemoteTier(rcfg, store.layout, **kw)
        log.info("remote tier: master %s, metadata %s, this node %s (bind %s), lends %d MiB, key prefix %r",
                 rcfg.master_address, rcfg.metadata_url, rcfg.local_hostname, cfg.resolved_remote_bind,
                 rcfg.global_segment_bytes >> 20, rcfg.key_prefix)
        return ClusterNode(store, remote, cfg.publish_policy())

    def _keep_remote(self) -> None:
        """Keeper thread: connect each layout's remote tier at start (or when the layout
        opens), reconnect it while it is down (as often as its backoff allows) and check it
        now and then while it is up, so that ``stats`` tells its state even when no request
        has touched it. Each time a tier comes up its node republishes the named prefixes: a
        restarted master has lost them."""
        probe = [b"\0" * 32]
        last_check: dict[str, float] = {}
        ups_seen: dict[str, int] = {}
        wait = 0.0
        while not self._remote_stop.wait(wait):
            wait = 0.25
            assert self.layouts is not None
            for entry in self.layouts.entries():
                node, lid = entry.store, entry.layout_id
                remote = getattr(node, "remote", None)
                if remote is None:
                    continue
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

    def _stop_remote_keeper(self) -> None:
        self._remote_stop.set()
        if self._remote_keeper is not None:
            rcfg = self.config.remote_config()
            self._remote_keeper.join(rcfg.setup_timeout_s + rcfg.op_timeout_s + 5 if rcfg else 5)
            self._remote_keeper = None
