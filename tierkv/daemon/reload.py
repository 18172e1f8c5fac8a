"""SIGHUP: re-read the daemon's config file, apply every setting that can change live, and
loudly refuse the rest (issue #34, item 12: a uid removed from ``allowed_uids`` kept its
connection and mappings; turning on ``namespace_per_uid`` or changing quotas by reload was
ignored without a log line).

Every setting (a key of DaemonConfig's sections: ``staging.timeout_s``) is in exactly one of
:data:`LIVE` and :data:`AT_RESTART` (a test checks it), so that no setting is ignored silently. A changed setting of ``AT_RESTART`` gets
a WARNING line naming it and why, and is listed as refused in the reload's result
(:class:`ReloadResult`, logged and reported in ``stats()["daemon"]["reload"]``); it applies
when the daemon restarts. Removing a uid from ``allowed_uids`` revokes it: its connections
are closed at once (an error frame naming the reason, then the socket), which ends their
leases, frees their staging and closes their tenant regions (LeaseHandlers.end_connection), and
the gate refuses its new connects.

:class:`Reload` is a part of :class:`~tierkv.daemon.server.Daemon`: it holds the settings
in force (the only thing that changes them) and the last result; the daemon hands in how
to push new settings to its other parts and how to cut off a uid's connections.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import TierKVError
from .config import KEYS, DaemonConfig
from .config.keys import value_of, with_values
from .security import PeerRejectedError

log = logging.getLogger("tierkv.daemon.server")  # the daemon's log (operators and tests filter on it)

# Applied by a reload, by key (config/keys.py). ``server.max_inflight`` and
# ``staging.per_client_bytes`` (a tenant's own regions) bound connections made after it; the
# quotas' ``idle_timeout_s`` too: a client pings at a third of the timeout it was told at
# HELLO, so a shorter one applied to it would close clients that are not idle. The other
# quotas apply at once.
LIVE = ("leases.timeout_s", "staging.timeout_s", "staging.per_client_bytes", "access.allowed_uids",
        "server.max_connections", "server.max_inflight",
        "layouts.idle_s",  # read at each tick of the loop (server.py)
        *(key for key in KEYS if key.startswith("quotas.")))
_ALLOCATED = "the tiers and the staging regions are allocated once, when the daemon starts"
_OPENED = "each layout's store is opened with it"
AT_RESTART: dict[str, str] = {
    "store.device_bytes": _ALLOCATED, "store.host_bytes": _ALLOCATED, "store.disk_bytes": _ALLOCATED,
    "staging.region_bytes": _ALLOCATED, "store.device": _ALLOCATED, "store.shm_dir": _ALLOCATED,
    "layouts.max_open": "the budgets are split 1/layouts.max_open when the daemon starts",
    "store.home": "the daemon holds its home for life", "server.socket": "the socket is bound when the daemon starts",
    "server.pid_file": "written when the daemon starts",
    "layouts.preload": "a layout is opened at start; clients declare theirs at HELLO",
    "server.workers": "the worker threads are made when the daemon starts",
    "store.write_through": _OPENED, "store.eviction_policy": _OPENED, "store.page_codec": _OPENED,
    "store.warm_at_open": _OPENED,
    "metrics.port": "the metrics endpoint is bound when the daemon starts", "metrics.host": "as metrics.port",
    # Not live, by decision: admitted uids were handed descriptors of memory at HELLO that
    # the daemon cannot take back from their processes (a mapping outlives the socket).
    # Turned on live, tenants connected before would keep read-write mappings of the whole
    # device pool and the shared staging region, so the isolation it promises would be
    # false until they are all gone; turned off live, every tenant's blocks and manifests
    # (stored under uid<N>/) would vanish from under its open connections, and a uid's own
    # leases would cross namespaces. A restart makes new memory and states it cleanly.
    "access.namespace_per_uid": "uids connected before were handed memory the daemon cannot take back from them "
                                "(see tierkv/daemon/reload.py)",
    **{key: "the remote tier is joined when the daemon starts" for key in KEYS
       if key.startswith(("remote.", "publish."))},
}


@dataclass(frozen=True)
class RefusedSetting:
    """A setting the reload changed but cannot apply live: it applies at the next start."""

    name: str
    old: str
    new: str
    why: str


@dataclass(frozen=True)
class ReloadResult:
    """What one reload did: ``applied`` (settings changed and in force now), ``refused``,
    ``revoked_uids`` (removed from allowed_uids) and the connections closed for them;
    ``error``: the file could not be read, nothing changed."""

    at: float = field(default_factory=time.time)
    applied: tuple[str, ...] = ()
    refused: tuple[RefusedSetting, ...] = ()
    revoked_uids: tuple[int, ...] = ()
    closed_connections: int = 0
    warnings: tuple[str, ...] = ()  # what the reload could not do fully, as logged
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"at": self.at, "applied": list(self.applied), "revoked_uids": list(self.revoked_uids),
                "refused": [{"name": r.name, "old": r.old, "new": r.new, "why": r.why} for r in self.refused],
                "closed_connections": self.closed_connections, "warnings": list(self.warnings), "error": self.error}


class Reload:
    """The daemon's settings in force, and SIGHUP's re-reading of them."""

    def __init__(self, config: DaemonConfig, read: Callable[[], DaemonConfig] | None,
                 apply: Callable[[DaemonConfig], None],
                 cut_off: Callable[[tuple[int, ...], Callable[[int], TierKVError]], int]) -> None:
        """``read``: the config file read again (None: there is none); ``apply``: puts new
        settings in force in the daemon's parts; ``cut_off``: closes every connection of
        the uids given, each told the reason made for its uid; returns how many it closed."""
        self.config = config
        self.read = read
        self._apply = apply
        self._cut_off = cut_off
        self.last: ReloadResult | None = None

    def last_dict(self) -> dict[str, Any] | None:
        """The last reload's result as reported in ``stats()["daemon"]["reload"]``."""
        return None if self.last is None else self.last.to_dict()

    def on_sighup(self) -> None:
        if self.read is None:
            log.warning("SIGHUP: no config file to reload")
            return
        try:
            new = self.read()
        except (TierKVError, ValueError, OSError) as e:
            log.error("SIGHUP: config not reloaded, nothing changed: %s", e)
            self.last = ReloadResult(error=str(e))
            return
        self.apply(new)

    def apply(self, new: DaemonConfig) -> ReloadResult:
        """Apply every changed setting of :data:`LIVE`, revoke the uids no longer allowed,
        and refuse (log at WARNING, list in the result) every changed one of
        :data:`AT_RESTART`. Runs on the loop thread."""
        old = self.config
        changed = [key for key in KEYS if value_of(new, key) != value_of(old, key)]
        refused = tuple(RefusedSetting(key, str(value_of(old, key)), str(value_of(new, key)), AT_RESTART[key])
                        for key in changed if key in AT_RESTART)
        for r in refused:
            log.warning("SIGHUP: %s changed (%s -> %s) but is not applied: %s; it applies when the daemon "
                        "restarts", r.name, r.old, r.new, r.why)
        sources = {**old.sources, **{key: new.sources[key] for key in LIVE if key in new.sources}}
        self.config = with_values(old, {key: value_of(new, key) for key in LIVE}, sources)
        self._apply(self.config)
        revoked = tuple(sorted(set(old.access.allowed_uids) - set(new.access.allowed_uids) - {os.getuid()}))
        closed, warnings = self._revoke(revoked) if revoked else (0, ())
        result = ReloadResult(applied=tuple(n for n in changed if n in LIVE), refused=refused,
                              revoked_uids=revoked, closed_connections=closed, warnings=warnings)
        self.last = result
        log.info("SIGHUP: reloaded (applied: %s; refused until restart: %s)", ", ".join(result.applied) or "nothing",
                 ", ".join(r.name for r in refused) or "nothing")
        return result

    def _revoke(self, uids: tuple[int, ...]) -> tuple[int, tuple[str, ...]]:
        """Close every connection of ``uids`` now; their leases, staging and tenant regions
        end with the connection. Returns how many were closed, and the warning about
        mappings it cannot take back, if any."""
        closed = self._cut_off(uids, lambda uid: PeerRejectedError(f"uid {uid} was removed from the daemon's "
                                                                   f"allowed_uids"))
        log.warning("SIGHUP: uid %s removed from allowed_uids: %d of its connections closed (their leases are "
                    "released, their staging freed, their tenant regions closed)", ", ".join(map(str, uids)), closed)
        if self.config.access.namespace_per_uid:
            return closed, ()
        # Without namespace_per_uid an admitted uid maps the shared tiers themselves (HELLO
        # hands it their descriptors), and closing its socket does not unmap them.
        warning = (f"without namespace_per_uid, uid {', '.join(map(str, uids))} was handed the shared tiers' "
                   f"memory; its processes may keep it mapped until the daemon restarts")
        log.warning("SIGHUP: %s", warning)
        return closed, (warning,)
