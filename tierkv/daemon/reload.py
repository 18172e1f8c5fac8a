"""SIGHUP: re-read the daemon's config file and apply what can change live (lease timeout,
staging quota, allowed uids, connection and in-flight limits); tier capacities and the
remote tier apply at the next start (logged). :class:`~tierkv.daemon.server.Daemon`
inherits these methods and owns the state they use (``config``, ``_reload``,
``handlers``, ``layouts``). Split out of server.py.
"""
from __future__ import annotations

import logging
from dataclasses import replace

from ..errors import TierKVError
from .config import REMOTE_FIELDS, DaemonConfig

log = logging.getLogger("tierkv.daemon.server")  # the daemon's log, as before the split


class Reload:
    """The reload methods of :class:`~tierkv.daemon.server.Daemon`."""

    def _on_sighup(self) -> None:
        if self._reload is None:
            log.warning("SIGHUP: no config file to reload")
            return
        try:
            new = self._reload()
        except (TierKVError, ValueError, OSError) as e:
            log.error("SIGHUP: config not reloaded: %s", e)
            return
        self.apply_reload(new)

    def apply_reload(self, new: DaemonConfig) -> None:
        """Apply what can change live; tier capacities apply at the next start."""
        old = self.config
        restart_only = ("device_bytes", "host_bytes", "disk_bytes", "staging_bytes", "device", "home", "socket",
                        "max_layouts", *REMOTE_FIELDS)
        for name in restart_only:
            if getattr(new, name) != getattr(old, name):
                log.warning("SIGHUP: %s changed (%s -> %s); it applies when the daemon restarts",
                            name, getattr(old, name), getattr(new, name))
        self.config = replace(old, lease_timeout_s=new.lease_timeout_s, staging_timeout_s=new.staging_timeout_s,
                              client_staging_bytes=new.client_staging_bytes,
                              allowed_uids=new.allowed_uids, max_connections=new.max_connections,
                              max_inflight=new.max_inflight)
        if self.handlers is not None:
            self.handlers.config = self.config
            self.handlers.leases.timeout_s = new.lease_timeout_s
            assert self.layouts is not None
            self.layouts.set_client_quota(min(new.client_staging_bytes, self.layouts.budget.staging_bytes))
        log.info("SIGHUP: reloaded (lease timeout %.0f s)", new.lease_timeout_s)
