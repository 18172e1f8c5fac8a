"""What the daemon does for each request: decode the message, run the store call in a
worker thread (the event loop never waits on the store lock or the disk), encode the reply.

Handlers run on the event loop; the lease and staging tables are touched only there.

Layouts (layouts.py): a connection is bound at HELLO to the layout it declares (opened on
first use), or to the daemon's only layout when it declares none; block requests (lookup,
acquire, put, prefetch, set_priority) go to that layout's store. Operations work across
every layout: manifests are found in whichever store holds them, chains by their last key,
and invalidate, verify and stats cover all stores (stats adds a per-layout breakdown).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch

from ..blocks import Priority
from ..errors import CapacityError, ConfigError, LeaseError, NotFoundError, ProtocolError, QuotaExceededError
from ..identity import Scope
from ..results import InvalidateResult, VerifyResult
from . import messages as m
from .layouts import LayoutEntry, Layouts, layout_id, merge_stats
from .leases import LeaseTable
from .quotas import QuotaRules
from .tenancy import Tenancy
from .protocol import VERSION, Op

if TYPE_CHECKING:
    from .config import DaemonConfig
    from .server import Connection

log = logging.getLogger(__name__)
Reply = tuple[dict[str, Any], bytes]
RELEASE_DRAIN_S = 0.002  # queued releases wait at most this for a store call to end them


def _acquire(store: Any, *args: Any) -> Any:
    """``store.acquire``; a miss (no blocks) is released at once, so it holds nothing."""
    lease = store.acquire(*args)
    if not lease.keys:
        store.release(lease)
    return lease


def region_info(tier: Any, fds: list[int]) -> dict[str, Any] | None:
    """How a client maps a memory tier: the index of its descriptor in ``fds`` (sent with
    the HELLO reply, SCM_RIGHTS: the client never opens a path), bytes, slot stride, count."""
    if tier.region is None:
        return None
    fds.append(tier.region.fd)
    return {"fd": len(fds) - 1, "nbytes": tier.region.nbytes, "stride_bytes": tier.stride_bytes,
            "slots": tier.slots.capacity}


def cuda_ipc_info(tier: Any) -> dict[str, Any] | None:
    """The device pool as a CUDA IPC handle (``storage._share_cuda_()``), for clients on the
    same GPU. UNTESTED here (no GPU in CI); the CPU path shares the pool as shm instead."""
    if tier.region is not None or tier.pool.device.type != "cuda":
        return None
    parts = tier.pool.untyped_storage()._share_cuda_()
    wire = [{"b": p.hex()} if isinstance(p, bytes) else p for p in parts]
    return {"storage": wire, "slots": tier.slots.capacity, "stride_bytes": tier.stride_bytes}


class Handlers:
    def __init__(self, layouts: Layouts, config: "DaemonConfig") -> None:
        self.layouts = layouts
        self.config = config
        self.tenancy = Tenancy(config.namespace_per_uid)
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="tierkv-daemon")
        self.leases = LeaseTable(config.lease_timeout_s)
        self._unreleased: collections.deque[Any] = collections.deque()  # store leases to end (any thread)
        self._flush_lock = threading.Lock()
        self._drain_handle: asyncio.TimerHandle | None = None
        self._drains: set[asyncio.Future] = set()
        self.quota = QuotaRules(config.quotas)
        self.peers: Callable[[], list[tuple[int, int]]] = lambda: []  # (conn id, uid) of each connection; server sets it
        # opcode -> (message class with decode(header, payload), handler)
        self.table: dict[int, tuple[Any, Callable[[Connection, Any], Awaitable[Reply]]]] = {
            Op.HELLO: (m.Hello, self.hello), Op.LOOKUP: (m.PrefixRequest, self.lookup),
            Op.ACQUIRE: (m.PrefixRequest, self.acquire), Op.RELEASE: (m.Release, self.release),
            Op.RENEW: (m.LeaseRef, self.renew), Op.STAGE: (m.Stage, self.stage), Op.UNSTAGE: (m.Unstage, self.unstage),
            Op.COMMIT: (m.Commit, self.commit), Op.PREFETCH: (m.PrefixRequest, self.prefetch),
            Op.SET_PRIORITY: (m.SetPriority, self.set_priority), Op.SAVE_MANIFEST: (m.ManifestRequest, self.save_manifest),
            Op.GET_MANIFEST: (m.ManifestRequest, self.get_manifest), Op.LIST_MANIFESTS: (m.Empty, self.list_manifests),
            Op.DELETE_MANIFEST: (m.ManifestRequest, self.delete_manifest), Op.INVALIDATE: (m.Invalidate, self.invalidate),
            Op.VERIFY: (m.Verify, self.verify), Op.STATS: (m.Empty, self.stats), Op.PING: (m.Empty, self.ping),
            Op.CHECK_INTEGRITY: (m.Empty, self.check_integrity),
            Op.CHAIN_TOKENS: (m.ChainRef, self.chain_tokens), Op.CHAIN_RESIDENCY: (m.ChainRef, self.chain_residency),
            Op.SET_PRIORITY_FROM: (m.ChainRef, self.set_priority_from),
        }

    async def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``fn(*args, **kw)`` in a worker thread, after the releases clients sent without
        waiting (so a connection's later request sees its own releases done)."""
        loop = asyncio.get_running_loop()

        def job() -> Any:
            self._flush_releases()
            return fn(*args, **kw)

        return await loop.run_in_executor(self.executor, job)

    # ---- releases nobody waits for ------------------------------------------------------------
    # A one-way RELEASE takes the lease out of the table on the loop and queues the store
    # lease; the next store call in any worker ends it first (no executor hop of its own),
    # or, when none comes within RELEASE_DRAIN_S, a drain does. The flush holds a lock, so a
    # store call that starts while another worker is ending queued leases waits for them.
    def _flush_releases(self) -> None:
        # Always through the lock (uncontended: ~0.1 us): a store call must not start while
        # another worker is still ending leases it popped from the queue.
        with self._flush_lock:
            while self._unreleased:
                lease = self._unreleased.popleft()
                try:
                    lease.store.release(lease)  # the store that issued it
                except Exception:  # noqa: BLE001 - one bad lease must not keep the others pinned
                    log.exception("releasing a lease failed")

    def _release_later(self, leases: list[Any]) -> None:
        self._unreleased.extend(leases)
        if self._drain_handle is None:
            loop = asyncio.get_running_loop()
            self._drain_handle = loop.call_later(RELEASE_DRAIN_S, self._start_drain)

    def _start_drain(self) -> None:
        self._drain_handle = None
        if self._unreleased:
            task = asyncio.ensure_future(self.run(lambda: None))
            self._drains.add(task)
            task.add_done_callback(self._drains.discard)

    async def settle_releases(self) -> None:
        """End every queued lease now (stopping, tests)."""
        await self.run(lambda: None)

    # ---- layout and scope: derived on the trusted side --------------------------------------
    def entry(self, conn: "Connection") -> LayoutEntry:
        """The layout a block request of ``conn`` goes to: the one bound at HELLO, else the
        daemon's only one; ConfigError when there is none or several."""
        entry = conn.entry or self.layouts.only()
        if entry is None:
            raise ConfigError("this connection declared no page layout, and the daemon serves none or several",
                              hint="connect with tierkv.connect(socket, layout=...) to store or read pages")
        return entry

    def stores(self, conn: "Connection") -> list[Any]:
        """Every layout's store, the connection's own first (where its manifests go)."""
        entries = self.layouts.entries()
        if conn.entry is not None:
            entries.sort(key=lambda e: e is not conn.entry)
        return [e.store for e in entries]

    def namespace_for(self, conn: "Connection", namespace: str) -> str:
        """The namespace the store sees. With ``namespace_per_uid`` every peer uid gets its
        own prefix, so tenants under different uids can neither hit nor probe each other."""
        return self.tenancy.namespace(conn.creds.uid, namespace)

    def scope(self, conn: "Connection", ws: m.WireScope) -> Scope:
        return Scope(ws.model_version, self.namespace_for(conn, ws.namespace), ws.extra_keys)

    # ---- handlers -----------------------------------------------------------------------------
    async def hello(self, conn: "Connection", msg: m.Hello) -> Reply:
        conn.client_pid = msg.pid
        if conn.entry is not None:
            raise ProtocolError("HELLO was sent twice on this connection")
        if msg.layout is not None:
            entry = self.layouts.get(layout_id(msg.layout))
            if entry is None:  # first use of this layout: open its store (seconds; off the loop)
                entry = await self.run(self.layouts.open, msg.layout)
        else:
            entry = self.layouts.only()
        conn.entry = entry
        header: dict[str, Any] = {
            "protocol": VERSION, "daemon_pid": os.getpid(), "lease_timeout_s": self.leases.timeout_s,
            "idle_timeout_s": self.config.quotas.idle_timeout_s,
            "namespace_per_uid": self.config.namespace_per_uid, "layouts": [e.layout_id for e in self.layouts.entries()],
            "layout": None,
        }
        fds: list[int] = []
        if entry is not None:
            st, pool = entry.local, entry.staging_pool  # the tiers clients map are the local store's
            header.update({
                "layout": entry.layout.to_dict(), "layout_id": entry.layout_id,
                "device": region_info(st.device, fds), "host": region_info(st.host, fds),
                "device_ipc": cuda_ipc_info(st.device),
                "staging": {"nbytes": pool.numel() * pool.element_size(), "stride_bytes": entry.layout.page_bytes,
                            "slots": pool.shape[0]},
                "stage_quota": entry.staging.quota,
            })
            fds.append(entry.staging_region.fd)
            header["staging"]["fd"] = len(fds) - 1
        return header, b"", fds  # type: ignore[return-value]  # the server sends fds with the reply

    async def lookup(self, conn: "Connection", msg: m.PrefixRequest) -> Reply:
        r = await self.run(self.entry(conn).store.lookup, msg.tokens, self.scope(conn, msg.scope), msg.block_extra)
        names = sorted(set(r.tiers))
        return m.KeysReply(r.keys, {"tokens_matched": r.tokens_matched, "tier_names": names},
                           tuple(names.index(t) for t in r.tiers)).encode()

    async def acquire(self, conn: "Connection", msg: m.PrefixRequest) -> Reply:
        entry, uid = self.entry(conn), conn.creds.uid
        tier = int(entry.local.device.slots.capacity)
        self.quota.check_lease(uid, [u for _, u in self.peers()], self.leases.count(conn.id), self.leases.blocks_of(uid),
                               tier)
        # The lease is counted from before the store call, so acquires in flight count: the
        # cap was checked before an await and concurrent acquires passed it together.
        reservation = self.leases.reserve(conn.id, uid, 0)
        try:
            lease = await self.run(_acquire, entry.store, msg.tokens, self.scope(conn, msg.scope), msg.block_extra,
                                   msg.max_blocks, msg.start_block)
            if lease.keys:
                try:  # the tier share, with what was leased (quotas.py)
                    self.quota.check_leased_blocks(uid, [u for _, u in self.peers()], self.leases.blocks_of(uid),
                                                   lease.num_blocks, tier)
                except QuotaExceededError:
                    self._release_later([lease])
                    raise
            # A miss holds nothing (released in the worker already): lease id 0, no table entry.
            lease_id = self.leases.add(conn.id, lease, uid).lease_id if lease.keys else 0
        finally:
            self.leases.unreserve(reservation)
        return m.KeysReply(lease.keys, {"lease_id": lease_id}, tuple(lease.slots)).encode()

    async def release(self, conn: "Connection", msg: m.Release) -> Reply | None:
        taken = [(i, self.leases.take(conn.id, i)) for i in msg.lease_ids]
        leases = [lease for _, lease in taken if lease is not None]
        unknown = [i for i, lease in taken if lease is None]
        self._release_later(leases)
        problem = (f"lease {', '.join(map(str, unknown))} is not held by this connection (released, or expired "
                   f"after {self.leases.timeout_s:g} s without renew)") if unknown else None
        if not msg.reply:
            if problem:
                log.info("connection %d: %s", conn.id, problem)
            return None  # the client waits for nothing
        if problem:
            raise LeaseError(problem)
        await self.settle_releases()
        return {}, b""

    async def renew(self, conn: "Connection", msg: m.LeaseRef) -> Reply:
        if not self.leases.renew(conn.id, msg.lease_id):
            raise LeaseError(f"lease {msg.lease_id} is not held by this connection (released or expired)")
        return {}, b""

    async def stage(self, conn: "Connection", msg: m.Stage) -> Reply:
        staging, uid = self.entry(conn).staging, conn.creds.uid
        peers = self.peers()
        self.quota.check_staging(uid, [u for _, u in peers], staging.held_by(c for c, u in peers if u == uid),
                                 msg.count, staging.slots.capacity)
        slots = staging.alloc(conn.id, msg.count)
        if slots is None:
            raise CapacityError(f"no {msg.count} staging slots free (quota {staging.quota} per connection)",
                                hint="put fewer blocks at once, or raise client_staging_bytes / staging_bytes")
        return {"slots": slots}, b""

    async def unstage(self, conn: "Connection", msg: m.Unstage) -> Reply:
        self.entry(conn).staging.free(conn.id, msg.slots)
        return {}, b""

    async def commit(self, conn: "Connection", msg: m.Commit) -> Reply:
        entry = self.entry(conn)
        if not entry.staging.owns(conn.id, msg.slots):
            raise ProtocolError("commit names staging slots this connection does not hold")
        if msg.priority == Priority.PINNED:
            try:
                await self._check_pinned(conn, entry.store, self.namespace_for(conn, msg.scope.namespace), len(msg.slots))
            except BaseException:
                entry.staging.free(conn.id, msg.slots)
                raise
        try:
            idx = torch.tensor(msg.slots, dtype=torch.long)
            # A private copy: the checksum and the stored bytes must be the same bytes even
            # if the client scribbles on its staging slots while the put runs.
            pages = await self.run(entry.staging_pool.index_select, 0, idx)
            r = await self.run(entry.store.put, msg.tokens, pages, self.scope(conn, msg.scope),
                               start_block=msg.start_block, block_extra=msg.block_extra, priority=Priority(msg.priority))
        finally:
            entry.staging.free(conn.id, msg.slots)
        return {"stored": r.stored, "skipped": r.skipped, "durable": r.durable}, b""

    async def prefetch(self, conn: "Connection", msg: m.PrefixRequest) -> Reply:
        fut = await self.run(self.entry(conn).store.prefetch, msg.tokens, self.scope(conn, msg.scope), msg.block_extra)
        return {"tokens_warm": await asyncio.wrap_future(fut)}, b""

    async def _check_pinned(self, conn: "Connection", store: Any, effective_ns: str, want: int) -> None:
        """The pinned quota (quotas.py) of this tenant: its uid's namespaces under
        namespace_per_uid, else the namespace being pinned."""
        uid, uids = conn.creds.uid, [u for _, u in self.peers()]
        if not self.quota.others_connected(uid, uids):
            return
        local = getattr(store, "store", store)  # a ClusterNode wraps the Store
        tenant = self.tenancy.namespace_prefix(uid) if self.config.namespace_per_uid else effective_ns
        pinned = await self.run(local.pinned_blocks, tenant)
        self.quota.check_pinned(uid, uids, tenant, pinned, want, int(local.disk.capacity_slots))

    async def set_priority(self, conn: "Connection", msg: m.SetPriority) -> Reply:
        if msg.priority == Priority.PINNED:
            entry = self.entry(conn)
            await self._check_pinned(conn, entry.store, self.namespace_for(conn, msg.scope.namespace),
                                     len(msg.tokens) // entry.layout.block_size)
        n = await self.run(self.entry(conn).store.set_priority, msg.tokens, self.scope(conn, msg.scope), Priority(msg.priority))
        return {"count": n}, b""

    def _chain(self, conn: "Connection", last_key: bytes) -> tuple[Any, Any]:
        """(store, ChainTokens) of the layout whose store holds the chain ending at
        ``last_key`` (keys are unique across layouts: the model version names the layout).
        Runs in a worker thread. NotFoundError when no store holds it."""
        for st in self.stores(conn):
            try:
                return st, st.chain_tokens(last_key)
            except NotFoundError:
                continue
        raise NotFoundError(f"block {last_key.hex()[:16]} is not stored")

    async def _own_chain(self, conn: "Connection", last_key: bytes) -> tuple[Any, Any, str, str]:
        """Store, tokens, model version and namespace (as the client names it) of the chain
        ending at ``last_key``. With ``namespace_per_uid`` a chain of another uid's namespace
        is reported as not stored: a key must not let one tenant read or pin another's."""
        st, (tokens, mv, ns) = await self.run(self._chain, conn, last_key)
        if self.config.namespace_per_uid:
            own = self.namespace_for(conn, "")
            if not ns.startswith(own):
                raise NotFoundError(f"block {last_key.hex()[:16]} is not stored")
            ns = ns[len(own):]
        return st, tokens, mv, ns

    async def chain_tokens(self, conn: "Connection", msg: m.ChainRef) -> Reply:
        _, tokens, mv, ns = await self._own_chain(conn, msg.last_key)
        return {"model_version": mv, "namespace": ns}, m.tokens_payload(tokens)

    async def chain_residency(self, conn: "Connection", msg: m.ChainRef) -> Reply:
        try:
            st, *_ = await self._own_chain(conn, msg.last_key)
        except NotFoundError:
            return {"residency": {"blocks": 0, "device": 0, "host": 0, "disk": 0}}, b""
        r = await self.run(st.chain_residency, msg.last_key)
        return {"residency": r.as_dict()}, b""

    async def set_priority_from(self, conn: "Connection", msg: m.ChainRef) -> Reply:
        if msg.priority is None:
            raise ProtocolError("set_priority_from needs a priority")
        try:
            st, tokens, _, ns = await self._own_chain(conn, msg.last_key)
        except NotFoundError:
            return {"count": 0}, b""
        if msg.priority == Priority.PINNED:
            await self._check_pinned(conn, st, self.namespace_for(conn, ns), len(tokens) // st.layout.block_size)
        return {"count": await self.run(st.set_priority_from, msg.last_key, Priority(msg.priority))}, b""

    async def save_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Reply:
        if msg.manifest is None:
            raise ProtocolError("save_manifest needs a manifest object")
        name = self.tenancy.manifest_name(conn.creds.uid, msg.name)
        await self.run(self._manifest_store(conn, msg.manifest).save_manifest, name, msg.manifest)
        return {}, b""

    def _manifest_store(self, conn: "Connection", manifest: dict) -> Any:
        """Where a manifest is saved: the store of the layout it names (``layout``, as
        materialize writes), else the connection's own, else the only one."""
        raw = manifest.get("layout")
        if isinstance(raw, dict):
            try:
                entry = self.layouts.get(layout_id(m.layout_from_wire(raw)))
            except ProtocolError:
                entry = None
            if entry is not None:
                return entry.store
        entry = conn.entry or self.layouts.only()
        if entry is None:
            raise ConfigError("the manifest names no layout this daemon serves, and this connection declared none",
                              hint="connect with tierkv.connect(socket, layout=...) before saving a manifest")
        return entry.store

    def _all_manifests(self, conn: "Connection") -> dict[str, tuple[Any, dict]]:
        """Stored name -> (store, manifest) over every layout; the connection's own store wins
        a name two stores hold. Runs in a worker thread."""
        out: dict[str, tuple[Any, dict]] = {}
        for st in reversed(self.stores(conn)):
            out.update({k: (st, v) for k, v in st.list_manifests().items()})
        return out

    async def get_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Reply:
        uid = conn.creds.uid
        every = await self.run(self._all_manifests, conn)
        hit = every.get(self.tenancy.manifest_name(uid, msg.name))
        if hit is None:
            # A tenant learns only its own names.
            mine = self.tenancy.visible_manifests(uid, {k: v for k, (_, v) in every.items()})
            raise NotFoundError(f"no prefix named {msg.name!r} (known: {', '.join(sorted(mine)) or 'none'})")
        return {"manifest": self.tenancy.visible_manifest(uid, hit[1])}, b""

    async def list_manifests(self, conn: "Connection", msg: m.Empty) -> Reply:
        uid = conn.creds.uid
        every = await self.run(self._all_manifests, conn)
        mine = self.tenancy.visible_manifests(uid, {k: v for k, (_, v) in every.items()})
        return {"manifests": {k: self.tenancy.visible_manifest(uid, v) for k, v in mine.items()}}, b""

    async def delete_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Reply:
        name = self.tenancy.manifest_name(conn.creds.uid, msg.name)
        deleted = [await self.run(st.delete_manifest, name) for st in self.stores(conn)]
        return {"deleted": any(deleted)}, b""

    async def invalidate(self, conn: "Connection", msg: m.Invalidate) -> Reply:
        if msg.namespace is not None or not self.config.namespace_per_uid:
            targets = [None if msg.namespace is None else self.namespace_for(conn, msg.namespace)]
        else:  # "every namespace" of a tenant is every namespace of its own, never another's
            if msg.model_version is None:
                raise ValueError("invalidate needs model_version or namespace")
            stored = {ns for st in self.stores(conn) for ns in (await self.run(st.stats))["namespaces"]}
            targets = self.tenancy.own_namespaces(conn.creds.uid, stored)  # type: ignore[assignment]
        removed = freed = 0
        if msg.model_version is None and targets == [None]:
            raise ValueError("invalidate needs model_version or namespace")
        for st in self.stores(conn):
            for ns in targets:
                r: InvalidateResult = await self.run(st.invalidate, model_version=msg.model_version, namespace=ns,
                                                     dry_run=msg.dry_run)
                removed += r.removed_blocks
                freed += r.freed_bytes
        return {"removed_blocks": removed, "freed_bytes": freed, "dry_run": msg.dry_run}, b""

    async def verify(self, conn: "Connection", msg: m.Verify) -> Reply:
        self.tenancy.check_whole_store(conn.creds.uid, "verify")
        results: list[VerifyResult] = [await self.run(st.verify, msg.repair) for st in self.stores(conn)]
        return {"checked": sum(r.checked for r in results), "corrupt": [k for r in results for k in r.corrupt],
                "repaired": msg.repair, "unreadable": [k for r in results for k in r.unreadable]}, b""

    async def stats(self, conn: "Connection", msg: m.Empty) -> Reply:
        s = await self.run(self.merged_stats)
        s["daemon"] = self.daemon_stats()
        # JSON in the payload (16 MiB), not the header (64 KiB): 3,000 namespaces overflowed
        # the header and stats failed for everyone (issue 11, item 9).
        return {"format": "json"}, json.dumps(self.tenancy.visible_stats(conn.creds.uid, s)).encode()

    def merged_stats(self) -> dict[str, Any]:
        """Every layout's stats summed (the JSON shape of StoreStats), with ``layouts``: the
        same figures per layout id. Runs in a worker thread (and for metrics scrapes)."""
        per = {e.layout_id: e.store.stats().as_dict() for e in self.layouts.entries()}
        return merge_stats(per, str(self.layouts.home))

    async def ping(self, conn: "Connection", msg: m.Empty) -> Reply:
        return {}, b""

    async def check_integrity(self, conn: "Connection", msg: m.Empty) -> Reply:
        """Every store's ``check_integrity`` (index against tiers, allocators, block table):
        ``error`` is the first failure's message, or null. What ``tierkv verify`` runs on a
        home it opens, so that ``--socket`` checks as much as ``--home``."""
        self.tenancy.check_whole_store(conn.creds.uid, "check_integrity")
        for st in self.stores(conn):
            try:
                await self.run(st.check_integrity)
            except AssertionError as e:
                return {"error": str(e) or "integrity check failed"}, b""
        return {"error": None}, b""

    def daemon_stats(self) -> dict[str, Any]:
        entries = self.layouts.entries()
        return {"pid": os.getpid(), "leases": len(self.leases),
                "staging_slots_used": sum(e.staging.slots.num_used for e in entries),
                "staging_slots": sum(e.staging.slots.capacity for e in entries),
                "layouts": [e.layout_id for e in entries], "max_layouts": self.layouts.max_layouts,
                "quota_refusals": dict(self.quota.refusals)}

    # ---- ending leases ------------------------------------------------------------------------
    async def release_all(self, leases: list) -> None:
        """Release store leases taken out of the table (dead connection, timeout)."""
        self._release_later(leases)
        await self.settle_releases()

    async def end_connection(self, conn: "Connection") -> int:
        leases = self.leases.take_connection(conn.id)
        for e in self.layouts.entries():  # a connection without HELLO may have staged on the only layout
            e.staging.free_connection(conn.id)
        await self.release_all(leases)
        return len(leases)

    async def expire_leases(self) -> int:
        expired = self.leases.take_expired()
        for h, _ in expired:
            log.warning("lease %d of connection %d expired after %.0f s without renew; released",
                        h.lease_id, h.conn_id, self.leases.timeout_s)
        await self.release_all([lease for _, lease in expired])
        return len(expired)
