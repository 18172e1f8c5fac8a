"""What the daemon does for each request: decode the message, run the store call in a
worker thread (the event loop never waits on the store lock or the disk), encode the reply.

Handlers run on the event loop; the lease and staging tables are touched only there.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import torch

from ..blocks import Priority
from ..errors import CapacityError, LeaseError, NotFoundError, ProtocolError
from ..identity import Scope
from ..store import Store
from . import messages as m
from .leases import LeaseTable, StagingSlots
from .tenancy import Tenancy
from .protocol import VERSION, Op

if TYPE_CHECKING:
    from .config import DaemonConfig
    from .server import Connection

log = logging.getLogger(__name__)
MAX_LEASES_PER_CONNECTION = 4096
Reply = tuple[dict[str, Any], bytes]


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
    def __init__(self, store: Store, config: "DaemonConfig", staging_pool: torch.Tensor, staging_region: Any) -> None:
        self.store = store
        self.config = config
        self.tenancy = Tenancy(config.namespace_per_uid)
        self.executor = ThreadPoolExecutor(config.workers, thread_name_prefix="tierkv-daemon")
        self.leases = LeaseTable(config.lease_timeout_s)
        self.staging_pool = staging_pool
        self.staging_region = staging_region
        page = store.layout.page_bytes
        self.staging = StagingSlots(staging_pool.shape[0], max(1, config.client_staging_bytes // page))
        # opcode -> (message class with decode(header, payload), handler)
        self.table: dict[int, tuple[Any, Callable[[Connection, Any], Awaitable[Reply]]]] = {
            Op.HELLO: (m.Hello, self.hello), Op.LOOKUP: (m.PrefixRequest, self.lookup),
            Op.ACQUIRE: (m.PrefixRequest, self.acquire), Op.RELEASE: (m.LeaseRef, self.release),
            Op.RENEW: (m.LeaseRef, self.renew), Op.STAGE: (m.Stage, self.stage), Op.UNSTAGE: (m.Unstage, self.unstage),
            Op.COMMIT: (m.Commit, self.commit), Op.PREFETCH: (m.PrefixRequest, self.prefetch),
            Op.SET_PRIORITY: (m.SetPriority, self.set_priority), Op.SAVE_MANIFEST: (m.ManifestRequest, self.save_manifest),
            Op.GET_MANIFEST: (m.ManifestRequest, self.get_manifest), Op.LIST_MANIFESTS: (m.Empty, self.list_manifests),
            Op.DELETE_MANIFEST: (m.ManifestRequest, self.delete_manifest), Op.INVALIDATE: (m.Invalidate, self.invalidate),
            Op.VERIFY: (m.Verify, self.verify), Op.STATS: (m.Empty, self.stats), Op.PING: (m.Empty, self.ping),
            Op.CHAIN_TOKENS: (m.ChainRef, self.chain_tokens), Op.CHAIN_RESIDENCY: (m.ChainRef, self.chain_residency),
            Op.SET_PRIORITY_FROM: (m.ChainRef, self.set_priority_from),
        }

    async def run(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kw))

    # ---- scope: derived on the trusted side ------------------------------------------------
    def namespace_for(self, conn: "Connection", namespace: str) -> str:
        """The namespace the store sees. With ``namespace_per_uid`` every peer uid gets its
        own prefix, so tenants under different uids can neither hit nor probe each other."""
        return self.tenancy.namespace(conn.creds.uid, namespace)

    def scope(self, conn: "Connection", ws: m.WireScope) -> Scope:
        return Scope(ws.model_version, self.namespace_for(conn, ws.namespace), ws.extra_keys)

    # ---- handlers -----------------------------------------------------------------------------
    async def hello(self, conn: "Connection", msg: m.Hello) -> Reply:
        conn.client_pid = msg.pid
        st = self.store
        fds: list[int] = []
        header = {
            "protocol": VERSION, "daemon_pid": os.getpid(), "layout": st.layout.to_dict(),
            "device": region_info(st.device, fds), "host": region_info(st.host, fds), "device_ipc": cuda_ipc_info(st.device),
            "staging": {"nbytes": self.staging_pool.numel() * self.staging_pool.element_size(),
                        "stride_bytes": st.layout.page_bytes, "slots": self.staging_pool.shape[0]},
            "stage_quota": self.staging.quota, "lease_timeout_s": self.leases.timeout_s,
            "namespace_per_uid": self.config.namespace_per_uid,
        }
        fds.append(self.staging_region.fd)
        header["staging"]["fd"] = len(fds) - 1
        return header, b"", fds  # type: ignore[return-value]  # the server sends fds with the reply

    async def lookup(self, conn: "Connection", msg: m.PrefixRequest) -> Reply:
        r = await self.run(self.store.lookup, msg.tokens, self.scope(conn, msg.scope), msg.block_extra)
        names = sorted(set(r.tiers))
        return m.KeysReply(r.keys, {"tokens_matched": r.tokens_matched, "tier_names": names},
                           tuple(names.index(t) for t in r.tiers)).encode()

    async def acquire(self, conn: "Connection", msg: m.PrefixRequest) -> Reply:
        if self.leases.count(conn.id) >= MAX_LEASES_PER_CONNECTION:
            raise CapacityError(f"this connection holds {MAX_LEASES_PER_CONNECTION} leases", hint="release some first")
        lease = await self.run(self.store.acquire, msg.tokens, self.scope(conn, msg.scope), msg.block_extra,
                               msg.max_blocks, msg.start_block)
        held = self.leases.add(conn.id, lease)
        return m.KeysReply(lease.keys, {"lease_id": held.lease_id}, tuple(lease.slots)).encode()

    async def release(self, conn: "Connection", msg: m.LeaseRef) -> Reply:
        lease = self.leases.take(conn.id, msg.lease_id)
        if lease is None:
            raise LeaseError(f"lease {msg.lease_id} is not held by this connection (released, or expired after "
                             f"{self.leases.timeout_s:g} s without renew)")
        await self.run(self.store.release, lease)
        return {}, b""

    async def renew(self, conn: "Connection", msg: m.LeaseRef) -> Reply:
        if not self.leases.renew(conn.id, msg.lease_id):
            raise LeaseError(f"lease {msg.lease_id} is not held by this connection (released or expired)")
        return {}, b""

    async def stage(self, conn: "Connection", msg: m.Stage) -> Reply:
        slots = self.staging.alloc(conn.id, msg.count)
        if slots is None:
            raise CapacityError(f"no {msg.count} staging slots free (quota {self.staging.quota} per connection)",
                                hint="put fewer blocks at once, or raise client_staging_bytes / staging_bytes")
        return {"slots": slots}, b""

    async def unstage(self, conn: "Connection", msg: m.Unstage) -> Reply:
        self.staging.free(conn.id, msg.slots)
        return {}, b""

    async def commit(self, conn: "Connection", msg: m.Commit) -> Reply:
        if not self.staging.owns(conn.id, msg.slots):
            raise ProtocolError("commit names staging slots this connection does not hold")
        try:
            idx = torch.tensor(msg.slots, dtype=torch.long)
            # A private copy: the checksum and the stored bytes must be the same bytes even
            # if the client scribbles on its staging slots while the put runs.
            pages = await self.run(self.staging_pool.index_select, 0, idx)
            r = await self.run(self.store.put, msg.tokens, pages, self.scope(conn, msg.scope),
                               start_block=msg.start_block, block_extra=msg.block_extra, priority=Priority(msg.priority))
        finally:
            self.staging.free(conn.id, msg.slots)
        return {"stored": r.stored, "skipped": r.skipped, "durable": r.durable}, b""

    async def prefetch(self, conn: "Connection", msg: m.PrefixRequest) -> Reply:
        fut = await self.run(self.store.prefetch, msg.tokens, self.scope(conn, msg.scope), msg.block_extra)
        return {"tokens_warm": await asyncio.wrap_future(fut)}, b""

    async def set_priority(self, conn: "Connection", msg: m.SetPriority) -> Reply:
        n = await self.run(self.store.set_priority, msg.tokens, self.scope(conn, msg.scope), Priority(msg.priority))
        return {"count": n}, b""

    async def _own_chain(self, conn: "Connection", last_key: bytes) -> tuple[Any, str, str]:
        """Tokens, model version and namespace (as the client names it) of the chain ending
        at ``last_key``. With ``namespace_per_uid`` a chain of another uid's namespace is
        reported as not stored: a key must not let one tenant read or pin another's."""
        tokens, mv, ns = await self.run(self.store.chain_tokens, last_key)
        if self.config.namespace_per_uid:
            own = self.namespace_for(conn, "")
            if not ns.startswith(own):
                raise NotFoundError(f"block {last_key.hex()[:16]} is not stored")
            ns = ns[len(own):]
        return tokens, mv, ns

    async def chain_tokens(self, conn: "Connection", msg: m.ChainRef) -> Reply:
        tokens, mv, ns = await self._own_chain(conn, msg.last_key)
        return {"model_version": mv, "namespace": ns}, m.tokens_payload(tokens)

    async def chain_residency(self, conn: "Connection", msg: m.ChainRef) -> Reply:
        if self.config.namespace_per_uid:
            await self._own_chain(conn, msg.last_key)
        r = await self.run(self.store.chain_residency, msg.last_key)
        return {"residency": r.as_dict() if hasattr(r, "as_dict") else dict(r)}, b""

    async def set_priority_from(self, conn: "Connection", msg: m.ChainRef) -> Reply:
        if msg.priority is None:
            raise ProtocolError("set_priority_from needs a priority")
        if self.config.namespace_per_uid:
            await self._own_chain(conn, msg.last_key)
        return {"count": await self.run(self.store.set_priority_from, msg.last_key, Priority(msg.priority))}, b""

    async def save_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Reply:
        if msg.manifest is None:
            raise ProtocolError("save_manifest needs a manifest object")
        await self.run(self.store.save_manifest, self.tenancy.manifest_name(conn.creds.uid, msg.name), msg.manifest)
        return {}, b""

    async def get_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Reply:
        uid = conn.creds.uid
        try:
            got = await self.run(self.store.get_manifest, self.tenancy.manifest_name(uid, msg.name))
        except NotFoundError:
            # The store's message lists every name; a tenant sees only its own.
            mine = self.tenancy.visible_manifests(uid, await self.run(self.store.list_manifests))
            raise NotFoundError(f"no prefix named {msg.name!r} (known: {', '.join(sorted(mine)) or 'none'})") from None
        return {"manifest": self.tenancy.visible_manifest(uid, got)}, b""

    async def list_manifests(self, conn: "Connection", msg: m.Empty) -> Reply:
        uid = conn.creds.uid
        mine = self.tenancy.visible_manifests(uid, await self.run(self.store.list_manifests))
        return {"manifests": {k: self.tenancy.visible_manifest(uid, v) for k, v in mine.items()}}, b""

    async def delete_manifest(self, conn: "Connection", msg: m.ManifestRequest) -> Reply:
        name = self.tenancy.manifest_name(conn.creds.uid, msg.name)
        return {"deleted": bool(await self.run(self.store.delete_manifest, name))}, b""

    async def invalidate(self, conn: "Connection", msg: m.Invalidate) -> Reply:
        if msg.namespace is not None or not self.config.namespace_per_uid:
            targets = [None if msg.namespace is None else self.namespace_for(conn, msg.namespace)]
        else:  # "every namespace" of a tenant is every namespace of its own, never another's
            if msg.model_version is None:
                raise ValueError("invalidate needs model_version or namespace")
            stored = (await self.run(self.store.stats))["namespaces"]
            targets = self.tenancy.own_namespaces(conn.creds.uid, stored)  # type: ignore[assignment]
        removed = freed = 0
        for ns in targets:
            r = await self.run(self.store.invalidate, model_version=msg.model_version, namespace=ns, dry_run=msg.dry_run)
            removed += r.removed_blocks
            freed += r.freed_bytes
        return {"removed_blocks": removed, "freed_bytes": freed, "dry_run": msg.dry_run}, b""

    async def verify(self, conn: "Connection", msg: m.Verify) -> Reply:
        self.tenancy.check_whole_store(conn.creds.uid, "verify")
        r = await self.run(self.store.verify, msg.repair)
        return {"checked": r.checked, "corrupt": list(r.corrupt), "repaired": r.repaired}, b""

    async def stats(self, conn: "Connection", msg: m.Empty) -> Reply:
        s = await self.run(self.store.stats)
        visible = self.tenancy.visible_stats(conn.creds.uid, s.with_sections(daemon=self.daemon_stats()).as_dict())
        # JSON in the payload (16 MiB), not the header (64 KiB): 3,000 namespaces overflowed
        # the header and stats failed for everyone (issue 11, item 9).
        return {"format": "json"}, json.dumps(visible).encode()

    async def ping(self, conn: "Connection", msg: m.Empty) -> Reply:
        return {}, b""

    def daemon_stats(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "leases": len(self.leases), "staging_slots_used": self.staging.slots.num_used,
                "staging_slots": self.staging.slots.capacity}

    # ---- ending leases ------------------------------------------------------------------------
    async def release_all(self, leases: list) -> None:
        """Release store leases taken out of the table (dead connection, timeout)."""
        for lease in leases:
            try:
                await self.run(self.store.release, lease)
            except Exception:  # noqa: BLE001 - one bad lease must not keep the others pinned
                log.exception("releasing a reclaimed lease failed")

    async def end_connection(self, conn: "Connection") -> int:
        leases = self.leases.take_connection(conn.id)
        self.staging.free_connection(conn.id)
        await self.release_all(leases)
        return len(leases)

    async def expire_leases(self) -> int:
        expired = self.leases.take_expired()
        for h, _ in expired:
            log.warning("lease %d of connection %d expired after %.0f s without renew; released",
                        h.lease_id, h.conn_id, self.leases.timeout_s)
        await self.release_all([lease for _, lease in expired])
        return len(expired)
