"""The daemon: the one process that opens a home, serving clients on a Unix socket.

Lifecycle: ``Daemon(config).run()`` takes the home (its LOCK names the socket, so a second
opener gets DaemonOwnsHomeError naming it) and opens a store for every page layout the home
holds (layouts.py; an empty home holds none: clients declare theirs at HELLO and the
daemon opens a store per layout on first use), binds the socket (security.py), writes the
pid file, starts the metrics endpoint, and serves until SIGTERM/SIGINT (or
:meth:`request_stop`). Stopping: no new connections, requests already received finish (a
put that was read is stored and acknowledged), every lease is released, the stores are
closed (which flushes write-back blocks), the socket and pid file are removed. SIGHUP re-reads the config file (reload.py): every
setting that can change live is applied (timeouts, quotas, limits, allowed uids: a uid
removed is cut off at once); the others (tier capacities, namespace_per_uid, ...) are
refused with a WARNING naming each, and apply at the next start.

Cluster: with ``remote_master`` set the daemon wraps each layout's store in a
:class:`~tierkv.cluster.ClusterNode` (lookups count the remote tier, acquires pull from it,
puts publish by the policy), sets ``MC_TCP_BIND_ADDRESS`` before any Mooncake client
exists, and connects the remote tier from a keeper thread: a master that is absent or
fails never stops the daemon, which serves locally meanwhile (docs/cluster.md; remote_keeper.py).

Accepting: gate.py reads the listening socket; a peer whose uid is not admitted is refused
there with one cheap close (no task, nothing read), refusals logged at most once per 10 s.
Per connection: frames are read in order; each request runs as its own task (at most
``max_inflight`` per connection) and replies carry the request id, so a slow put does not
hold up a lookup. Two kinds are served as they are read, without a task: a one-way
release, and an acquire that can finish at once (``Handlers.now``); while the read loop
waits for a frame, those are answered as their bytes arrive, before the loop wakes
(fast_path.py). A bad head (magic, version, length) or a truncated frame gets one error
reply and the connection is closed; an undecodable header or unknown opcode gets an error
reply and the connection goes on. Either way other clients are unaffected. The read loop
and the running of requests: serving.py; a connection's state and its replies:
connection.py.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..config import StoreConfig
from ..devices import resolve_device
from ..errors import ConfigError, TierKVError
from ..home.lock import LentLock
from ..layout import PageLayout
from ..core.store import Store
from ..tiers.shm import default_shm_dir
from . import security
from .config import DaemonConfig
from .connection import Connection
from .fast_path import FastPath, FastProtocol
from .gate import Gate, admit_with
from .gc_pauses import GcPauses, freeze_startup_heap
from .handlers import Handlers
from .layouts import Layouts, ServedStore
from .metrics import DaemonMetrics
from .operation_handlers import merged_stats
from .reload import Reload
from .remote_keeper import RemoteKeeper
from .serving import OP_NAMES, Serving
from ..home.budgets import Budget, TierLimits

log = logging.getLogger(__name__)


class Daemon:
    """Owns its parts: the settings in force and their reload (``reload``), the remote
    tier's keeper (``remote_keeper``), the GC pause counter; once running, the layouts'
    stores (``layouts``), the request handlers (``handlers``), the connections and their
    serving (``connections``, ``serving``), the metrics, the gate and the fast path. Each
    part is handed what it needs when it is made; none reads the daemon's attributes."""

    def __init__(self, config: DaemonConfig, *, reload: Callable[[], DaemonConfig] | None = None,
                 install_signals: bool = True, remote_backend_factory: Callable[[Any], Any] | None = None,
                 freeze_heap: bool = False) -> None:
        """``reload``: reads the config file again (SIGHUP); ``remote_backend_factory``: a
        stand-in for the Mooncake client (tests); ``freeze_heap``: this process is the
        daemon (``tierkv serve``): its startup heap is frozen out of garbage collection
        before the stores open (tierkv.daemon.gc_pauses)."""
        self._freeze_heap = freeze_heap
        self._install_signals = install_signals
        self._uid = os.getuid()
        self.gc_pauses = GcPauses()
        self.reload = Reload(config, reload, self._apply_settings, self._cut_off)
        self.remote_keeper = RemoteKeeper(config, remote_backend_factory)
        self.connections: dict[int, Connection] = {}  # kept by serving (serving.py)
        self.ready = threading.Event()
        self.metrics_port: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self.layouts: Layouts | None = None
        self.handlers: Handlers | None = None
        self.metrics: DaemonMetrics | None = None
        self.serving: Serving | None = None
        self.gate: Gate | None = None
        self.fast: FastPath | None = None

    @property
    def config(self) -> DaemonConfig:
        """The settings in force (a reload changes the live ones: reload.py)."""
        return self.reload.config

    # ---- opening and closing -----------------------------------------------------------
    @property
    def store(self) -> ServedStore | None:
        """The store when the daemon serves exactly one layout (tests and tools), else None."""
        entry = self.layouts.only() if self.layouts is not None else None
        return None if entry is None else entry.store

    def _open_store(self, home: Path, layout: PageLayout, limits: TierLimits,
                    home_lock: LentLock | None) -> tuple[ServedStore, Store]:
        """One layout's store, its tiers mapped at the whole budgets and limited to its share
        ``limits`` (wrapped in a ClusterNode when the remote tier is on), and the local Store;
        ``home_lock``: the daemon's LOCK of the home, lent to the store at the root.
        Called by :class:`Layouts`, at start or on first use. Tiers that cannot be sparse
        (a CUDA device pool; a page-locked host pool) are mapped at 1/max_layouts instead
        (layouts.py)."""
        cfg = self.config
        n = cfg.layouts.resolved_max_open
        cuda = torch.cuda.is_available()
        device_cuda = (cfg.store.device or ("cuda" if cuda else "cpu")).startswith("cuda")
        # Segments no bigger than the smallest share, as a tier of that size would have them.
        segment_pages = max(1, min(StoreConfig.segment_pages, cfg.store.disk_bytes // n // layout.slot_bytes))
        local = Store(StoreConfig(
            home=home, layout=layout, device=cfg.store.device,
            device_bytes=cfg.store.device_bytes // n if device_cuda else cfg.store.device_bytes,
            host_bytes=cfg.store.host_bytes // n if cuda else cfg.store.host_bytes,
            disk_bytes=cfg.store.disk_bytes, device_limit_bytes=limits.device_bytes, host_limit_bytes=limits.host_bytes,
            disk_limit_bytes=limits.disk_bytes, segment_pages=segment_pages, write_through=cfg.store.write_through,
            shm_dir=cfg.store.shm_dir, eviction_policy=cfg.store.eviction_policy, page_codec=cfg.store.page_codec,
            # A daemon starts ahead of its clients: it has the idle time to fault its tiers in
            # and (store.warm_at_open) to read back what its device tier held when it stopped.
            populate_memory=True, warm_at_open=cfg.store.warm_at_open,
        ), socket_path=str(cfg.server.socket), home_lock=home_lock)
        if not cfg.remote.enabled:
            return local, local
        try:
            return self.remote_keeper.join_cluster(local), local
        except BaseException:
            local.close()
            raise

    def _open(self, stop: asyncio.Event) -> socket.socket:
        """Take the home and make the parts that serve it: layouts, metrics, handlers,
        serving; bind the socket, write the pid file, start the metrics endpoint."""
        cfg = self.config
        if cfg.store.device is not None:
            resolve_device(cfg.store.device)  # refuse to start: else every client's first store open fails
        security.prepare_socket_dir(cfg.server.socket.parent, shared=bool(cfg.access.allowed_uids))
        security.clear_socket_path(cfg.server.socket)  # refuse early, before taking the home
        shm_dir = cfg.store.shm_dir or default_shm_dir()  # opening a store reaps dead processes' regions
        n = cfg.layouts.resolved_max_open
        staging = cfg.staging.region_bytes // n
        budget = Budget(cfg.store.device_bytes, cfg.store.host_bytes, cfg.store.disk_bytes, staging,
                        min(cfg.staging.per_client_bytes, staging))
        layouts = self.layouts = Layouts(cfg.store.home, str(cfg.server.socket), n, budget, shm_dir, self._open_store)
        sock = None
        try:
            layouts.start(cfg.layouts.preload)
            only = layouts.only()
            metrics = self.metrics = DaemonMetrics(lambda: merged_stats(layouts), self._daemon_stats,
                                                   only.layout.page_bytes if only is not None else 0)
            refusals = metrics.quota_refusals
            connections = self.connections
            self.handlers = Handlers(
                layouts, cfg, peers=lambda: [(c.id, c.creds.uid) for c in connections.values()],
                bound=lambda: [c.entry for c in connections.values()], gc_stats=self.gc_pauses.stats,
                reload_stats=self.reload.last_dict, on_quota_refusal=lambda quota: refusals.labels(quota).inc())
            self.serving = Serving(cfg, self.handlers, metrics, connections, stop.is_set)
            sock = security.bind_private_socket(cfg.server.socket, shared=bool(cfg.access.allowed_uids))
            security.write_pid_file(cfg.server.resolved_pid_file)
            if cfg.metrics.port is not None:
                try:
                    self.metrics_port = metrics.start(cfg.metrics.port, cfg.metrics.host)
                except OSError as e:
                    raise ConfigError(f"cannot serve metrics on {cfg.metrics.host}:{cfg.metrics.port}: {e.strerror or e}",
                                      hint="choose a free --metrics-port, or an address of this machine for "
                                           "--metrics-host") from None
                log.info("metrics on http://%s:%d/metrics", cfg.metrics.host, self.metrics_port)
        except BaseException:
            # Undo in reverse: nothing of a daemon that failed to start may stay behind.
            if sock is not None:
                sock.close()
                cfg.server.socket.unlink(missing_ok=True)
                cfg.server.resolved_pid_file.unlink(missing_ok=True)
            if self.handlers is not None:
                self.handlers.workers.shutdown(wait=False)
            layouts.close()
            raise
        return sock

    def _daemon_stats(self) -> dict[str, Any]:
        d = self.handlers.daemon_stats() if self.handlers else {}
        d["connections"] = len(self.connections)
        d["refused_peers"] = self.gate.refused if self.gate is not None else 0
        return d

    def _admitted(self, uid: int) -> bool:
        """The gate's test: the daemon's own uid or one of ``allowed_uids`` (read live:
        SIGHUP changes it)."""
        return uid == self._uid or uid in self.config.access.allowed_uids

    # ---- a reload's effects (reload.py decides them) ---------------------------------------
    def _apply_settings(self, config: DaemonConfig) -> None:
        """Put the settings a reload changed in force in each part that holds them."""
        if self.handlers is not None:
            self.handlers.apply_config(config)
        if self.layouts is not None:
            self.layouts.set_client_quota(min(config.staging.per_client_bytes, self.layouts.budget.staging_bytes))
        if self.fast is not None:
            self.fast.unread_reply_bytes = config.quotas.unread_reply_bytes
        if self.serving is not None:
            self.serving.apply_config(config)

    def _cut_off(self, uids: tuple[int, ...], why: Callable[[int], TierKVError]) -> int:
        return self.serving.cut_off(uids, why) if self.serving is not None else 0

    # ---- running -------------------------------------------------------------------------
    def run(self) -> None:
        """Open, serve until stopped, close. Blocks; call from the main thread to get
        signal handling (tests run it in a thread with ``install_signals=False``)."""
        if self._install_signals:
            # Until the loop's handler is installed, SIGHUP's default action would kill a
            # daemon that is still opening (a reload sent too early by a supervisor).
            signal.signal(signal.SIGHUP, signal.SIG_IGN)
        if self._freeze_heap:
            freeze_startup_heap()
        self.gc_pauses.install()
        try:
            asyncio.run(self._main())
        finally:
            self.gc_pauses.uninstall()

    def request_stop(self) -> None:
        """Ask a running daemon to stop (thread-safe)."""
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)

    async def _main(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        stop = self._stop = asyncio.Event()
        sock = self._open(stop)
        handlers, layouts, serving, metrics = self.handlers, self.layouts, self.serving, self.metrics
        assert handlers is not None and layouts is not None and serving is not None and metrics is not None
        fast = self.fast = FastPath(handlers, self.config.quotas.unread_reply_bytes, stop.is_set, metrics, OP_NAMES)

        def connection() -> FastProtocol:  # = asyncio.start_unix_server's, with the fast path
            return FastProtocol(asyncio.StreamReader(loop=loop), serving.on_connect, loop, fast)

        # Accepting is the gate's (gate.py): a peer not admitted costs one cheap close.
        setting_up: set[asyncio.Task] = set()
        gate = self.gate = Gate(sock, loop, self._admitted, admit_with(loop, connection, setting_up),
                                on_refuse=metrics.rejected.labels("uid").inc)
        gate.start()
        if self._install_signals:
            loop.add_signal_handler(signal.SIGTERM, stop.set)
            loop.add_signal_handler(signal.SIGINT, stop.set)
            loop.add_signal_handler(signal.SIGHUP, self.reload.on_sighup)
        sweeper = asyncio.create_task(self._sweep_leases(handlers, layouts))
        if self.config.remote.enabled:
            self.remote_keeper.start(layouts.entries)
        log.info("tierkv daemon (pid %d) serving %s on %s (layouts: %s)", os.getpid(), self.config.store.home,
                 self.config.server.socket, ", ".join(e.layout_id for e in layouts.entries()) or "none yet")
        self.ready.set()
        try:
            await stop.wait()
        finally:
            log.info("stopping: finishing in-flight requests")
            gate.close()
            sweeper.cancel()
            if setting_up:
                await asyncio.wait(list(setting_up))
            await serving.drain()
            await handlers.workers.settle()  # one-way releases still queued
            handlers.workers.shutdown(wait=True)
            self.remote_keeper.stop()
            layouts.close()  # flushes write-back blocks, releases the home
            for p in (self.config.server.socket, self.config.server.resolved_pid_file):
                Path(p).unlink(missing_ok=True)
            metrics.stop()
            log.info("stopped cleanly")

    async def _sweep_leases(self, handlers: Handlers, layouts: Layouts) -> None:
        while True:
            await asyncio.sleep(min(1.0, handlers.leases.timeout_s / 4, self.config.staging.timeout_s / 4))
            await handlers.lease_ops.expire_leases()
            handlers.expire_staging([c.tenant.staging for c in self.connections.values() if c.tenant is not None])
            if any(e.over_limit for e in layouts.entries()):
                await handlers.run(layouts.retrim)  # blocks held when a limit was lowered
            if len(layouts) > 1:
                await self._share_among_layouts_in_use(handlers, layouts)

    async def _share_among_layouts_in_use(self, handlers: Handlers, layouts: Layouts) -> None:
        """Give the memory share of a layout no connection used for ``layout_idle_s`` to
        those in use (home/budgets.py); a HELLO takes it back (Handlers.hello)."""
        now = time.monotonic()
        for c in self.connections.values():
            if c.entry is not None:
                c.entry.last_bound = now
        in_use = {e.layout_id for e in layouts.entries() if now - e.last_bound < self.config.layouts.idle_s}
        if in_use and in_use != layouts.in_use:
            await handlers.run(layouts.rebalance, in_use, now)

    def check_integrity(self) -> None:
        """Cross-check the daemon's lease table, every layout's staging table and store, and
        that each connection's leases are leases of a store the daemon serves."""
        assert self.handlers is not None and self.layouts is not None
        self.handlers.leases.check_integrity()
        self.layouts.check_integrity()
        served = [e.store for e in self.layouts.entries()]
        for conn in self.connections.values():
            assert conn.entry is None or any(conn.entry.store is s for s in served), \
                f"connection {conn.id} bound to a layout the daemon no longer serves"
