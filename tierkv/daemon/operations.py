"""The operations handlers: requests that work across every layout the daemon serves
rather than on a connection's own pages (chains by their last key, manifests, invalidate,
verify, gc, stats, ping, check_integrity, remove_layout). The rules across layouts are the
home's (:class:`tierkv.home.Home`, run here on a view of the daemon's stores with the
connection's own first), so ``--home`` and ``--socket`` answer alike; what is added here is
the tenant's view (tierkv/home/tenancy.py) and the wire.

:class:`OperationHandlers` is a part of :class:`~tierkv.daemon.handlers.Handlers`, which
hands it the layouts, the tenancy and the services it shares with the other handlers; it
holds no state of its own.
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any, AsyncContextManager, Awaitable, Callable

from ..api import StoreAPI
from ..blocks import Priority
from ..errors import LayoutInUseError, NotFoundError, ProtocolError
from ..home.home import Home
from ..results import DEFAULT_STATS_NAMESPACES, InvalidateResult, VerifyResult, namespace_page
from ..store import Store
from . import messages as m
from .layouts import LayoutEntry, Layouts
from .messages import Answer
from ..home.tenancy import Tenancy
from ..home.tenant import TenantView

if TYPE_CHECKING:
    from .connection import Connection

# The largest page of namespaces one stats reply carries, whatever the client asks: at
# ~100 bytes a name (with each layout's copy) it stays far below the 16 MiB payload limit.
MAX_STATS_NAMESPACES = 10_000


def merged_stats(layouts: Layouts) -> dict[str, Any]:
    """Every layout's stats summed (the JSON shape of StoreStats), with ``layouts``: the
    same figures per layout id. Runs in a worker thread (and for metrics scrapes)."""
    return Home(layouts.home, [e.store for e in layouts.entries()]).merged_stats()


class OperationHandlers:
    """The handlers of the requests across every layout."""

    def __init__(self, layouts: Layouts, tenancy: Tenancy, *, run: Callable[..., Awaitable[Any]],
                 namespace_for: Callable[["Connection", str], str],
                 pin_guard: Callable[["Connection", Store, int, int], AsyncContextManager[None]],
                 daemon_stats: Callable[[], dict[str, Any]],
                 bound: Callable[[], list[LayoutEntry | None]]) -> None:
        """``run``: a call in a worker thread; ``namespace_for``: the namespace the store
        sees for a connection's; ``pin_guard``: the pinned quota around a call that may pin;
        ``daemon_stats``: the daemon's own figures; ``bound``: each connection's layout."""
        self.layouts = layouts
        self.tenancy = tenancy
        self.run = run
        self.namespace_for = namespace_for
        self.pin_guard = pin_guard
        self.daemon_stats = daemon_stats
        self.bound = bound

    def stores(self, conn: "Connection") -> list[StoreAPI]:
        """Every layout's store, the connection's own first (where its manifests go)."""
        entries = self.layouts.entries()
        if conn.entry is not None:
            entries.sort(key=lambda e: e is not conn.entry)
        return [e.store for e in entries]

    def home_view(self, conn: "Connection") -> Home:
        """Every store this daemon serves as one home, the connection's own first (where a
        manifest naming no layout goes, and whose manifest wins a name two stores hold)."""
        return Home(self.layouts.home, self.stores(conn), own=None if conn.entry is None else conn.entry.store)

    async def _own_chain(self, conn: "Connection", last_key: bytes) -> tuple[LayoutEntry, Any, str, str]:
        """The layout, tokens, model version and namespace (as the client names it) of the
        chain ending at ``last_key``. With ``namespace_per_uid`` a chain of another uid's
        namespace is reported as not stored: a key must not let one tenant read or pin another's."""
        st, (tokens, mv, ns) = await self.run(self.home_view(conn).find_chain, last_key)
        if self.tenancy.per_uid:
            own = self.namespace_for(conn, "")
            if not ns.startswith(own):
                raise NotFoundError(f"block {last_key.hex()[:16]} is not stored")
            ns = ns[len(own):]
        return self.layouts.entry_of(st), tokens, mv, ns

    async def chain_tokens(self, conn: "Connection", msg: m.ChainRef) -> Answer:
        _, tokens, mv, ns = await self._own_chain(conn, msg.last_key)
        return {"model_version": mv, "namespace": ns}, m.tokens_payload(tokens)

    async def chain_residency(self, conn: "Connection", msg: m.ChainRef) -> Answer:
        try:
            entry, *_ = await self._own_chain(conn, msg.last_key)
        except NotFoundError:
            return {"residency": {"blocks": 0, "device": 0, "host": 0, "disk": 0}}, b""
        r = await self.run(entry.store.chain_residency, msg.last_key)
        return {"residency": r.as_dict()}, b""

    async def set_priority_from(self, conn: "Connection", msg: m.ChainRef) -> Answer:
        if msg.priority is None:
            raise ProtocolError("set_priority_from needs a priority")
        try:
            entry, tokens, *_ = await self._own_chain(conn, msg.last_key)
        except NotFoundError:
            return {"count": 0}, b""
        async with self.pin_guard(conn, entry.local, msg.priority, len(tokens) // entry.layout.block_size):
            return {"count": await self.run(entry.store.set_priority_from, msg.last_key, Priority(msg.priority))}, b""

    def tenant_view(self, conn: "Connection") -> TenantView:
        """The home as this connection's uid sees it (its namespaces, its manifest names)."""
        return TenantView(self.home_view(conn), self.tenancy, conn.creds.uid)

    async def save_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Answer:
        if msg.manifest is None:
            raise ProtocolError("save_manifest needs a manifest object")
        await self.run(self.tenant_view(conn).save_manifest, msg.name, msg.manifest)
        return {}, b""

    async def get_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Answer:
        return {"manifest": await self.run(self.tenant_view(conn).get_manifest, msg.name)}, b""

    async def list_manifests(self, conn: "Connection", msg: m.Empty) -> Answer:
        return {"manifests": await self.run(self.tenant_view(conn).list_manifests)}, b""

    async def delete_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Answer:
        return {"deleted": await self.run(self.tenant_view(conn).delete_manifest, msg.name)}, b""

    async def invalidate(self, conn: "Connection", msg: m.Invalidate) -> Answer:
        r: InvalidateResult = await self.run(lambda: self.tenant_view(conn).invalidate(
            model_version=msg.model_version, namespace=msg.namespace, dry_run=msg.dry_run))
        return {"removed_blocks": r.removed_blocks, "freed_bytes": r.freed_bytes, "dry_run": msg.dry_run}, b""

    async def gc(self, conn: "Connection", msg: m.Gc) -> Answer:
        """``tierkv gc --socket``: tierkv.gc's rule run here, over every store this daemon
        serves as one (Home, as ``gc --home`` sees the home), so that it sees every
        tenant's manifests and namespaces. Through a connection's tenant view it found no
        model version (hidden from tenants) and removed nothing without a word (issue #34,
        item 5). Removing other tenants' blocks is the daemon's uid's (NotPermittedError
        for a tenant under namespace_per_uid). The result (which can list many prefixes)
        travels as JSON in the payload, as stats does."""
        from ..gc import collect

        self.tenancy.check_whole_store(conn.creds.uid, "gc")
        r = await self.run(collect, self.home_view(conn), msg.keep_model_versions, msg.keep_namespaces, msg.dry_run)
        return {"format": "json"}, json.dumps(r.as_dict()).encode()

    async def verify(self, conn: "Connection", msg: m.Verify) -> Answer:
        self.tenancy.check_whole_store(conn.creds.uid, "verify")
        r: VerifyResult = await self.run(self.home_view(conn).verify, msg.repair)
        return {"checked": r.checked, "corrupt": list(r.corrupt), "repaired": msg.repair,
                "unreadable": list(r.unreadable)}, b""

    async def stats(self, conn: "Connection", msg: m.Stats) -> Answer:
        s = await self.run(merged_stats, self.layouts)
        s["daemon"] = self.daemon_stats()
        # JSON in the payload (16 MiB), not the header (64 KiB): 3,000 namespaces overflowed
        # the header and stats failed for everyone (issue 11, item 9). And a page of the
        # namespaces, never more than MAX_STATS_NAMESPACES, so the reply stays bounded
        # however many exist; a tenant's own namespaces are picked out before paging.
        uid = conn.creds.uid
        limit = min(msg.namespace_limit or DEFAULT_STATS_NAMESPACES, MAX_STATS_NAMESPACES)
        out = self.tenancy.visible_stats(uid, s)
        out["namespaces"], after = namespace_page(out["namespaces"], limit, msg.namespace_after)
        if after is not None:
            out["namespaces_next"] = after
        layouts: dict[str, Any] = {}
        for lid, ls in s["layouts"].items():  # each layout's figures: the namespaces of this page only
            ls = self.tenancy.visible_stats(uid, ls)
            page = {ns: n for ns, n in ls["namespaces"].items() if ns in out["namespaces"]}
            layouts[lid] = {**ls, "namespaces": page}
        out["layouts"] = layouts
        return {"format": "json"}, json.dumps(out).encode()

    async def remove_layout(self, conn: "Connection", msg: m.LayoutRef) -> Answer:
        """Remove a layout's store (``tierkv layouts rm``): refused while a connection is
        bound to it (its clients may hold leases and staging slots). The check and taking it
        out happen on the event loop with no await between, so no HELLO binds it meanwhile;
        closing and deleting run in a worker thread (Layouts.drop)."""
        self.tenancy.check_whole_store(conn.creds.uid, "remove_layout")
        entry = self.layouts.get(msg.layout_id)
        users = sum(1 for e in self.bound() if entry is not None and e is entry)
        if users:
            raise LayoutInUseError(f"layout {msg.layout_id} is used by {users} connection(s) of this daemon")
        entry = self.layouts.take(msg.layout_id)
        stats = await self.run(lambda: entry.store.stats().as_dict())
        await self.run(self.layouts.drop, entry)
        return {"removed_blocks": stats["blocks"], "freed_bytes": stats["tiers"]["disk"]["used_bytes"]}, b""

    async def ping(self, conn: "Connection", msg: m.Empty) -> Answer:
        return {}, b""

    async def check_integrity(self, conn: "Connection", msg: m.Empty) -> Answer:
        """Every store's ``check_integrity`` (index against tiers, allocators, block table):
        ``error`` is the first failure's message, or null. What ``tierkv verify`` runs on a
        home it opens, so that ``--socket`` checks as much as ``--home``."""
        self.tenancy.check_whole_store(conn.creds.uid, "check_integrity")
        try:
            await self.run(self.home_view(conn).check_integrity)
        except AssertionError as e:
            return {"error": str(e) or "integrity check failed"}, b""
        return {"error": None}, b""
