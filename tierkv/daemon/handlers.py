"""What the daemon does for each request: decode the message, run the store call in a
worker thread (the event loop never waits on the store lock or the disk), encode the reply.

Handlers run on the event loop; the lease and staging tables are touched only there.

Layouts (layouts.py): a connection is bound at HELLO to the layout it declares (opened on
first use), or to the daemon's only layout when it declares none; block requests (lookup,
acquire, put, prefetch, set_priority) go to that layout's store. Operations work across
every layout: manifests are found in whichever store holds them, chains by their last key,
and invalidate, verify and stats cover all stores (stats adds a per-layout breakdown).

:class:`Handlers` owns what the handlers share (the lease table, the quota rules, the
tenancy, the worker threads: workers.py) and two parts it hands them to: the lease handlers
(acquire, release, renew: lease_handlers.py) and the operations across layouts
(operation_handlers.py); HELLO, lookup, staging, commit, prefetch and priorities are its own. Its
dispatch table maps each opcode to a :class:`~tierkv.daemon.routes.Route`: the message class
and the bound handler of whichever owns it, typed together.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import TYPE_CHECKING, Any, AsyncContextManager, AsyncIterator, Callable

import torch

from ..core.blocks import Priority
from ..errors import CapacityError, ConfigError, ProtocolError, QuotaExceededError, StagingExpiredError
from ..home.directory import layout_id
from ..home.tenancy import Tenancy
from ..identity import Scope
from ..results import LookupResult
from . import messages as m
from .config import shown
from .layouts import LayoutEntry, Layouts
from .lease_handlers import LeaseHandlers, inline_ok
from .leases import LeaseTable, StagingSlots
from .messages import Answer
from .operation_handlers import OperationHandlers
from .protocol import VERSION, Op
from .quotas import PinnedCounts, QuotaRules
from .routes import Route
from .tenant_regions import TenantRegions
from .workers import Workers

if TYPE_CHECKING:
    from ..core.store import Store
    from ..tiers.memory import MemoryTier
    from .config import DaemonConfig
    from .connection import Connection

log = logging.getLogger(__name__)
SCOPE_CACHE = 4096  # scopes kept built (model version, namespace, extras): see scope()


def region_info(tier: MemoryTier, fds: list[int]) -> dict[str, Any] | None:
    """How a client maps a memory tier: the index of its descriptor in ``fds`` (sent with
    the HELLO reply, SCM_RIGHTS: the client never opens a path), bytes, slot stride, count."""
    if tier.region is None:
        return None
    fds.append(tier.region.fd)
    return {"fd": len(fds) - 1, "nbytes": tier.region.nbytes, "stride_bytes": tier.stride_bytes,
            "slots": tier.slots.capacity}


def cuda_ipc_info(tier: MemoryTier) -> dict[str, Any] | None:
    """The device pool as a CUDA IPC handle (``storage._share_cuda_()``), for clients on the
    same GPU. UNTESTED here (no GPU in CI); the CPU path shares the pool as shm instead."""
    if tier.region is not None or tier.pool.device.type != "cuda":
        return None
    parts = tier.pool.untyped_storage()._share_cuda_()
    wire = [{"b": p.hex()} if isinstance(p, bytes) else p for p in parts]
    return {"storage": wire, "slots": tier.slots.capacity, "stride_bytes": tier.stride_bytes}


class Handlers:
    """The request handlers, by opcode (:attr:`table`, :attr:`now`)."""

    def __init__(self, layouts: Layouts, config: "DaemonConfig", *, peers: Callable[[], list[tuple[int, int]]],
                 bound: Callable[[], list[LayoutEntry | None]], gc_stats: Callable[[], dict[str, Any]],
                 reload_stats: Callable[[], dict[str, Any] | None],
                 on_quota_refusal: Callable[[str], None] | None = None) -> None:
        """What the daemon hands in: ``peers``, (connection id, uid) of each connection;
        ``bound``, each connection's layout; ``gc_stats``, the process's GC pauses
        (gc_pauses.py); ``reload_stats``, the last SIGHUP's result (reload.py);
        ``on_quota_refusal``, called with the quota's name each time one refuses (metrics)."""
        self.layouts = layouts
        self.config = config
        self.peers = peers
        self.bound = bound
        self.gc_stats = gc_stats
        self.reload_stats = reload_stats
        self.tenancy = Tenancy(config.access.namespace_per_uid)
        self.workers = Workers(config.server.workers)
        self.run = self.workers.run  # a store call in a worker thread
        self.leases = LeaseTable(config.leases.timeout_s)
        self.quota = QuotaRules(config.quotas, on_quota_refusal)
        self._pin_lock = asyncio.Lock()  # pins checked and stored one at a time (pin_guard)
        self.fast_path_requests = 0  # requests answered as they arrived (fast_path.py counts them)
        self._scopes: dict[tuple[str, str, tuple[str, ...]], Scope] = {}
        self.lease_ops = LeaseHandlers(layouts, self.leases, self.quota, self.workers, entry=self.entry,
                                       scope=self.scope, peers=peers)
        self.operations = OperationHandlers(layouts, self.tenancy, run=self.run, pin_guard=self.pin_guard,
                                            daemon_stats=self.daemon_stats, bound=bound, leases=self.leases)
        lease, ops = self.lease_ops, self.operations
        # opcode -> its message class and handler (routes.py: typed together); LOOKUP and
        # ACQUIRE have a synchronous form too, tried first as the request is read.
        self.table: dict[int, Route] = {
            Op.HELLO: Route(m.Hello, self.hello), Op.LOOKUP: Route(m.PrefixRequest, self.lookup, now=self.lookup_now),
            Op.ACQUIRE: Route(m.PrefixRequest, lease.acquire, now=lease.acquire_now),
            Op.RELEASE: Route(m.Release, lease.release), Op.RENEW: Route(m.LeaseRef, lease.renew),
            Op.STAGE: Route(m.Stage, self.stage), Op.UNSTAGE: Route(m.Unstage, self.unstage),
            Op.COMMIT: Route(m.Commit, self.commit), Op.PREFETCH: Route(m.PrefixRequest, self.prefetch),
            Op.SET_PRIORITY: Route(m.SetPriority, self.set_priority),
            Op.SAVE_MANIFEST: Route(m.ManifestRequest, ops.save_manifest),
            Op.GET_MANIFEST: Route(m.ManifestRequest, ops.get_manifest),
            Op.LIST_MANIFESTS: Route(m.Empty, ops.list_manifests),
            Op.DELETE_MANIFEST: Route(m.ManifestRequest, ops.delete_manifest),
            Op.INVALIDATE: Route(m.Invalidate, ops.invalidate), Op.VERIFY: Route(m.Verify, ops.verify),
            Op.STATS: Route(m.Stats, ops.stats), Op.PING: Route(m.Empty, ops.ping),
            Op.CHECK_INTEGRITY: Route(m.Empty, ops.check_integrity),
            Op.CHAIN_TOKENS: Route(m.ChainRef, ops.chain_tokens),
            Op.CHAIN_RESIDENCY: Route(m.ChainRef, ops.chain_residency),
            Op.SET_PRIORITY_FROM: Route(m.ChainRef, ops.set_priority_from),
            Op.REMOVE_LAYOUT: Route(m.LayoutRef, ops.remove_layout), Op.GC: Route(m.Gc, ops.gc),
        }
        # The opcodes with a synchronous form (the server and the fast path test each frame's).
        self.now = frozenset(op for op, route in self.table.items() if route.serve_now is not None)

    def apply_config(self, config: "DaemonConfig") -> None:
        """The settings a reload changed (reload.py): in force from the next request."""
        self.config = config
        self.leases.timeout_s = config.leases.timeout_s
        self.quota.quotas = config.quotas

    # ---- layout and scope: derived on the trusted side --------------------------------------
    def entry(self, conn: "Connection") -> LayoutEntry:
        """The layout a block request of ``conn`` goes to: the one bound at HELLO, else the
        daemon's only one; ConfigError when there is none or several."""
        entry = conn.entry or self.layouts.only()
        if entry is None:
            raise ConfigError("this connection declared no page layout, and the daemon serves none or several",
                              hint="connect with tierkv.connect(socket, layout=...) to store or read pages")
        return entry

    def namespace_for(self, conn: "Connection", namespace: str) -> str:
        """The namespace the store sees. With ``namespace_per_uid`` every peer uid gets its
        own prefix, so tenants under different uids can neither hit nor probe each other."""
        return self.tenancy.namespace(conn.creds.uid, namespace)

    def scope(self, conn: "Connection", ws: m.WireScope) -> Scope:
        """The store's scope of a request. Scopes are immutable and their seed (a hash) is
        computed once: the same few are reused (bounded) instead of rebuilt per request."""
        ident = (ws.model_version, self.namespace_for(conn, ws.namespace), ws.extra_keys)
        scope = self._scopes.get(ident)
        if scope is None:
            if len(self._scopes) >= SCOPE_CACHE:
                self._scopes.clear()
            scope = self._scopes[ident] = Scope(*ident)
        return scope

    # ---- handlers -----------------------------------------------------------------------------
    async def hello(self, conn: "Connection", msg: m.Hello) -> Answer:
        conn.client_pid = msg.pid
        if conn.entry is not None:
            raise ProtocolError("HELLO was sent twice on this connection")
        if msg.layout is not None:
            entry = self.layouts.get(layout_id(msg.layout))
            if entry is None:  # first use of this layout: open its store (seconds; off the loop)
                creator = None if conn.creds.uid == os.getuid() else conn.creds.uid
                try:
                    entry = await self.run(self.layouts.open, msg.layout, creator,
                                           self.config.quotas.layouts_per_uid)
                except QuotaExceededError:
                    self.quota.count("layouts")
                    raise
        else:
            entry = self.layouts.only()
        if entry is not None:
            entry.last_bound = time.monotonic()
            if entry.layout_id not in self.layouts.in_use:  # idle: its memory share back first (home/budgets.py)
                await self.run(self.layouts.rebalance, self.layouts.in_use | {entry.layout_id})
        conn.entry = entry
        header: dict[str, Any] = {
            "protocol": VERSION, "daemon_pid": os.getpid(), "lease_timeout_s": self.leases.timeout_s,
            "idle_timeout_s": conn.idle_timeout_s,
            "namespace_per_uid": self.config.access.namespace_per_uid,
            "layouts": [e.layout_id for e in self.layouts.entries()],
            # What the daemon puts before this peer's namespaces (from SO_PEERCRED): the
            # client keys its manifests' chains as stored (Client.block_keys).
            "namespace_prefix": self.tenancy.namespace_prefix(conn.creds.uid),
            "layout": None,
        }
        fds: list[int] = []
        if entry is not None and self.is_tenant(conn):
            conn.tenant = TenantRegions(self.layouts.shm_dir, entry.layout, self.config.staging.per_client_bytes)
            header.update({"layout": entry.layout.to_dict(), "layout_id": entry.layout_id,
                           **conn.tenant.hello_fields(fds)})
        elif entry is not None:
            st, pool = entry.local, entry.staging_pool  # the tiers clients map are the local store's
            header.update({
                "layout": entry.layout.to_dict(), "layout_id": entry.layout_id,
                "device": region_info(st.device, fds), "host": None if st.host.encoded else region_info(st.host, fds),  # int8 pages: not the layout's
                "device_ipc": cuda_ipc_info(st.device),
                "staging": {"nbytes": pool.numel() * pool.element_size(), "stride_bytes": entry.layout.page_bytes,
                            "slots": pool.shape[0]},
                "stage_quota": entry.staging.quota,
            })
            fds.append(entry.staging_region.fd)
            header["staging"]["fd"] = len(fds) - 1
        return header, b"", fds  # type: ignore[return-value]  # the server sends fds with the reply

    def lookup_now(self, conn: "Connection", msg: m.PrefixRequest) -> Answer | None:
        """The lookup on the event loop as the request is read (fast_path.py): metadata only,
        no hop to a worker (a lookup alone took 0.58-0.82 ms a round trip through one, 0.33-0.51
        so, 2026-12-07). Under the acquire's rules (LeaseHandlers._acquire_inline): the local
        store (a cluster node's lookup may ask its peers), a bounded prompt, the store lock
        free now (``inline_ok``). None otherwise: :meth:`lookup` runs in a worker."""
        entry = self.entry(conn)
        if not inline_ok(entry, msg):
            return None
        r = entry.local.try_lookup(msg.tokens, self.scope(conn, msg.scope), msg.block_extra)
        return None if r is None else _lookup_reply(r)

    async def lookup(self, conn: "Connection", msg: m.PrefixRequest) -> Answer:
        r = await self.run(self.entry(conn).store.lookup, msg.tokens, self.scope(conn, msg.scope), msg.block_extra)
        return _lookup_reply(r)

    def is_tenant(self, conn: "Connection") -> bool:
        """Another uid under namespace_per_uid: it maps only memory of its own connection."""
        return self.config.access.namespace_per_uid and conn.creds.uid != os.getuid()

    def staging_of(self, conn: "Connection") -> tuple[StagingSlots, torch.Tensor]:
        """The staging slots and pool a connection puts through: its own for a tenant."""
        if conn.tenant is not None:
            return conn.tenant.staging, conn.tenant.staging_pool
        entry = self.entry(conn)
        return entry.staging, entry.staging_pool

    async def stage(self, conn: "Connection", msg: m.Stage) -> Answer:
        if conn.tenant is not None:  # its own region: no other connection's quota to share
            slots = conn.tenant.staging.alloc(conn.id, msg.count)
            if slots is None:
                raise CapacityError(f"no {msg.count} staging slots free in this connection's region",
                                    hint="put fewer blocks at once, or raise client_staging_bytes")
            return {"slots": slots}, b""
        staging, uid = self.entry(conn).staging, conn.creds.uid
        peers = self.peers()
        self.quota.check_staging(uid, [u for _, u in peers], staging.held_by(c for c, u in peers if u == uid),
                                 msg.count, staging.slots.capacity)
        slots = staging.alloc(conn.id, msg.count)
        if slots is None:
            raise CapacityError(f"no {msg.count} staging slots free (quota {staging.quota} per connection)",
                                hint="put fewer blocks at once, or raise client_staging_bytes / staging_bytes")
        return {"slots": slots}, b""

    async def unstage(self, conn: "Connection", msg: m.Unstage) -> Answer:
        self.staging_of(conn)[0].free(conn.id, msg.slots)
        return {}, b""

    async def commit(self, conn: "Connection", msg: m.Commit) -> Answer:
        entry = self.entry(conn)
        staging, staging_pool = self.staging_of(conn)
        if not staging.owns(conn.id, msg.slots):
            if staging.expired(conn.id, msg.slots):
                raise StagingExpiredError(f"staging slots of this commit were held over staging_timeout_s = "
                                          f"{self.config.staging.timeout_s:g} s and were taken back; nothing stored")
            raise ProtocolError("commit names staging slots this connection does not hold")
        staging.begin_commit(conn.id, msg.slots)  # no longer expire: this commit copies them
        try:
            async with self.pin_guard(conn, entry.local, msg.priority, len(msg.slots)):
                idx = torch.tensor(msg.slots, dtype=torch.long)
                # A private copy: the checksum and the stored bytes must be the same bytes even
                # if the client scribbles on its staging slots while the put runs.
                pages = await self.run(staging_pool.index_select, 0, idx)
                r = await self.run(entry.store.put, msg.tokens, pages, self.scope(conn, msg.scope),
                                   start_block=msg.start_block, block_extra=msg.block_extra,
                                   priority=Priority(msg.priority))
        finally:
            staging.free(conn.id, msg.slots)
        return {"stored": r.stored, "skipped": r.skipped, "durable": r.durable}, b""

    def expire_staging(self, tenant_staging: list[StagingSlots]) -> int:
        """Take back staging slots held over ``staging_timeout_s`` (leases.py, StagingSlots):
        the shared regions' and ``tenant_staging``, the tenants' own. Returns how many."""
        timeout, n = self.config.staging.timeout_s, 0
        for staging in [e.staging for e in self.layouts.entries()] + tenant_staging:
            for conn_id, slots in staging.take_expired(timeout).items():
                n += len(slots)
                log.warning("connection %d held %d staging slots over %.0f s without commit; taken back",
                            conn_id, len(slots), timeout)
        return n

    async def prefetch(self, conn: "Connection", msg: m.PrefixRequest) -> Answer:
        fut = await self.run(self.entry(conn).store.prefetch, msg.tokens, self.scope(conn, msg.scope), msg.block_extra)
        return {"tokens_warm": await asyncio.wrap_future(fut)}, b""

    def pin_guard(self, conn: "Connection", local: "Store", priority: int, want: int) -> AsyncContextManager[None]:
        """Around a store call that may pin ``want`` blocks of the layout whose Store is
        ``local``: the pinned quota's check and the call as one step (quotas.py), or
        nothing to do."""
        if priority != Priority.PINNED:
            return contextlib.nullcontext()
        return self._pinning(conn, local, want)

    @contextlib.asynccontextmanager
    async def _pinning(self, conn: "Connection", local: "Store", want: int) -> AsyncIterator[None]:
        uid = conn.creds.uid
        if not self.config.access.allowed_uids and not self.quota.others_connected(uid, (u for _, u in self.peers())):
            yield  # a daemon of one user: nobody to share the disk tier with
            return
        # Checked and pinned under one lock: a check before an await let 16 concurrent
        # pinned puts pass it together (issue 34, item 9). Pins are rare (materialise):
        # serialising them costs the data path nothing.
        async with self._pin_lock:
            tenant = self.tenancy.namespace_prefix(uid) if self.config.access.namespace_per_uid else None
            total = await self.run(local.pinned_blocks, "")
            own = await self.run(local.pinned_blocks, tenant) if tenant is not None else 0
            disk_slots = local.disk.segment_limit * local.disk.segment_pages  # this layout's share
            self.quota.check_pinned(uid, [u for _, u in self.peers()], PinnedCounts(total, tenant, own), want,
                                    int(disk_slots))
            yield

    async def set_priority(self, conn: "Connection", msg: m.SetPriority) -> Answer:
        entry = self.entry(conn)
        async with self.pin_guard(conn, entry.local, msg.priority, len(msg.tokens) // entry.layout.block_size):
            n = await self.run(entry.store.set_priority, msg.tokens, self.scope(conn, msg.scope),
                               Priority(msg.priority))
        return {"count": n}, b""

    def daemon_stats(self) -> dict[str, Any]:
        entries = self.layouts.entries()
        return {"pid": os.getpid(), "leases": len(self.leases),
                "staging_slots_used": sum(e.staging.slots.num_used for e in entries),
                "staging_slots": sum(e.staging.slots.capacity for e in entries),
                "layouts": [e.layout_id for e in entries], "max_layouts": self.layouts.max_layouts,
                "budgets": {"device_bytes": self.layouts.budget.device_bytes,
                            "host_bytes": self.layouts.budget.host_bytes,
                            "disk_bytes": self.layouts.budget.disk_bytes},
                "over_limit_slots": {e.layout_id: e.over_limit for e in entries if e.over_limit},
                # What each layout's store read back at its open (docs/operations.md, "Restarts").
                "warm_start": {e.layout_id: e.local.warm_start.stats() for e in entries},
                "quota_refusals": dict(self.quota.refusals), "acquires": dict(self.lease_ops.acquires),
                "fast_path_requests": self.fast_path_requests, "gc": self.gc_stats(), "reload": self.reload_stats(),
                "config": shown(self.config)}  # each setting and where it came from (`tierkv config show`)


def _lookup_reply(r: LookupResult) -> Answer:
    names = sorted(set(r.tiers))
    return m.KeysReply(r.keys, {"tokens_matched": r.tokens_matched, "tier_names": names},
                       tuple(names.index(t) for t in r.tiers)).encode()
