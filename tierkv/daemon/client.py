"""A client of ``tierkv serve`` with the embedded store's API: ``tierkv.connect(socket)``.

Control messages go through the socket; page bytes never do. At connect the client checks
that the listener runs as root, as this user or as ``daemon_uid`` (SO_PEERCRED), then maps
the daemon's shared-memory tiers (the device tier on CPU, the host tier, and a staging
region) from the file descriptors sent with the HELLO reply (SCM_RIGHTS;
:meth:`SharedRegion.attach_fd`, never a path) and builds the same pool view the daemon has, so
``lease.page(i)`` is a view of the daemon's slot and ``lease.pages()`` copies straight out
of shared memory. New pages are written into staging slots the daemon hands out, then
committed; the daemon stores them with ``Store.put``.

On CUDA the daemon shares its device pool through a CUDA IPC handle instead
(:func:`tierkv.daemon.remote_lease.cuda_pool`); that path is UNTESTED here (no GPU in CI).

Thread safety: one socket and a send lock; replies are matched to requests by id and read
by the waiting callers themselves, one at a time (no reader thread), so several threads may
call one client at once. The client holds its connection (:class:`ClientTransport`,
client_transport.py) and owns only what a store's API needs beyond it: the mapped pools,
the leases it issued, the prefetch thread.
"""
from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..backoff import Backoff
from ..api import StoreAPI
from ..blocks import Priority
from ..errors import CapacityError, ConfigError, LeaseError, NotPermittedError, ProtocolError
from ..gc import GcResult
from ..identity import Scope, as_token_array
from ..layout import PageLayout
from ..results import (
    ChainTokens, InvalidateResult, Lease, LookupResult, PutResult, RemoveLayoutResult, Residency, StoreStats,
    VerifyResult, namespace_page,
)
from ..tiers.shm import SharedRegion
from . import messages as m
from .client_transport import ClientTransport
from .protocol import VERSION, Op, close_fds
from .remote_lease import RemoteLease, map_pools


class Client(StoreAPI):
    """Connected to a daemon; implements :class:`~tierkv.api.StoreAPI` like the embedded
    store (data stays in shared memory). ``layout`` is None for a client that declared none
    on a daemon serving several layouts: it offers operations only."""

    def __init__(self, socket_path: Path, timeout: float = 60.0, connect_timeout: float = 5.0,
                 daemon_uid: int | None = None, layout: PageLayout | None = None) -> None:
        """``layout``: the page layout this client stores and reads; the daemon opens a
        store for it on first use (one daemon serves several layouts). Without it the client
        gets the daemon's layout when it serves exactly one, else no data path (lookup,
        acquire, put, ... raise ConfigError): what operations tools need.
        ``daemon_uid``: the uid the daemon runs as when it is neither root nor this user
        (the listener's uid is checked before anything is sent or mapped)."""
        self._transport = ClientTransport(Path(socket_path), timeout, connect_timeout, daemon_uid)
        self._leases: dict[int, RemoteLease] = {}
        self._prefetch_lock = threading.Lock()  # makes _prefetcher once
        self._prefetcher: ThreadPoolExecutor | None = None  # waits for prefetch replies (made on first use)
        self._regions: list[SharedRegion] = []
        try:
            hello = self._transport.call_frame(Op.HELLO, m.Hello(VERSION, os.getpid(), layout))
            fds = list(hello.fds)
            try:
                self._setup(hello.header, fds)  # takes (and sets to -1) the descriptors it maps
            finally:
                close_fds([fd for fd in fds if fd >= 0])
        except BaseException:
            self.close()
            raise

    def _setup(self, hello: dict[str, Any], fds: list[int]) -> None:
        idle = hello.get("idle_timeout_s")
        if isinstance(idle, (int, float)) and idle > 0:
            self._transport.start_keepalive(float(idle))
        self.daemon_pid = int(hello["daemon_pid"])
        self.lease_timeout_s = float(hello["lease_timeout_s"])
        self.layouts = tuple(str(x) for x in hello.get("layouts", ()))  # the daemon's, at connect
        self.namespace_prefix = str(hello.get("namespace_prefix") or "")  # namespace_per_uid: "uid<N>/"
        self.layout: PageLayout | None = None
        self.device_pool = self.host_pool = self.staging_pool = None  # type: ignore[assignment]
        self.stage_quota = 0
        if hello.get("layout") is None:
            return  # no layout declared, and the daemon serves none or several: operations only
        self.layout = PageLayout.from_dict(hello["layout"])
        self.stage_quota = int(hello["stage_quota"])
        self._regions, self.device_pool, self.host_pool, self.staging_pool = map_pools(hello, fds, self.layout)

    @property
    def socket_path(self) -> Path:
        return self._transport.socket_path

    @property
    def timeout(self) -> float:
        """How long a request waits for its reply (seconds)."""
        return self._transport.timeout

    def _need_layout(self) -> PageLayout:
        if self.layout is None:
            raise ConfigError(
                f"this client declared no page layout and the daemon on {self.socket_path} serves "
                f"{len(self.layouts) or 'no'} layouts ({', '.join(self.layouts) or 'none yet'})",
                hint="connect with tierkv.connect(socket, layout=...) to store or read pages")
        return self.layout

    @staticmethod
    def _req(tokens: Any, scope: Scope, block_extra: Any = None, max_blocks: int | None = None,
             start_block: int = 0) -> m.PrefixRequest:
        return m.PrefixRequest(m.WireScope.of(scope),
                               as_token_array(tokens), block_extra, max_blocks, start_block)

    # ---- data path -------------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
               block_extra: Sequence[Sequence[str | bytes]] | None = None) -> LookupResult:
        f = self._transport.call_frame(Op.LOOKUP, self._req(tokens, scope, block_extra))
        r = m.KeysReply.decode(f.header, f.payload)
        names = r.fields.get("tier_names")
        if not isinstance(names, list) or len(r.values) != len(r.keys) or not all(0 <= v < len(names) for v in r.values):
            raise ProtocolError("lookup reply: tiers do not match its keys")
        return LookupResult(int(r.fields["tokens_matched"]), r.keys, tuple(str(names[v]) for v in r.values))

    def acquire(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None,
                start_block: int = 0, promote: bool = True) -> RemoteLease:
        # ``promote`` is a hint the daemon has no use for: its clients read its device tier.
        self._need_layout()
        if start_block < 0:
            raise ValueError("start_block must be >= 0")
        f = self._transport.call_frame(Op.ACQUIRE, self._req(tokens, scope, block_extra, max_blocks, start_block))
        r = m.KeysReply.decode(f.header, f.payload)
        slots = r.values
        n_pool = self.device_pool.shape[0]
        if len(slots) != len(r.keys) or (slots and not (min(slots) >= 0 and max(slots) < n_pool)):
            raise ProtocolError(f"daemon returned device slots outside the pool of {n_pool}")
        lease = RemoteLease(store=self, layout=self.layout, keys=r.keys, slots=slots, pool=self.device_pool,
                            lease_id=int(r.fields["lease_id"]), timeout_s=self.lease_timeout_s,
                            start_block=start_block)
        if lease.lease_id:  # 0: a miss, nothing held
            self._leases[lease.lease_id] = lease
        return lease

    def release(self, lease: Lease) -> None:
        if lease.store is not self or not isinstance(lease, RemoteLease):
            raise LeaseError("lease released on a client that did not issue it")
        if lease.released:
            raise LeaseError("lease released twice")
        lease.released = True
        self._leases.pop(lease.lease_id, None)
        if lease.lease_id == 0:
            return  # a miss: the daemon holds nothing for it
        if time.monotonic() - lease.renewed_at > self.lease_timeout_s:
            raise LeaseError(f"lease {lease.lease_id} expired ({self.lease_timeout_s:g} s without renew); "
                             "the daemon released it already")
        # One write, no round trip: the daemon ends the lease before any later request of
        # this connection reaches the store (handlers.py), so this client reads its writes.
        self._transport.send_oneway(Op.RELEASE, m.Release((lease.lease_id,), reply=False))

    def renew(self, lease: RemoteLease) -> None:
        """Restart the lease's idle timeout."""
        self._transport.call(Op.RENEW, m.LeaseRef(lease.lease_id))
        lease.renewed_at = time.monotonic()

    def block_keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, n_blocks: int | None = None,
                   block_extra: Sequence[Sequence[str | bytes]] | None = None) -> list[bytes]:
        """The keys the daemon keeps these blocks under: under ``namespace_per_uid`` it puts
        this peer's prefix (HELLO) before the namespace, so keys of the namespace as sent
        named nothing (a tenant's named prefix could not be pinned, exported or listed)."""
        if self.layout is None:
            raise ConfigError("block keys need a page layout", hint="connect with layout=...")
        if self.namespace_prefix:
            scope = Scope(scope.model_version, self.namespace_prefix + scope.namespace, scope.extra_keys)
        return super().block_keys(tokens, scope, n_blocks, block_extra)

    def put(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, pages: torch.Tensor, scope: Scope, *,
            start_block: int = 0, block_extra: Sequence[Sequence[str | bytes]] | None = None,
            priority: Priority = Priority.NORMAL) -> PutResult:
        """Same as :meth:`Store.put`. Pages go through staging slots in shared memory, in
        chunks of at most the daemon's per-connection quota (smaller, and after a wait,
        while other clients hold the staging region)."""
        self._need_layout().check_pages(pages)
        arr = as_token_array(tokens)
        ws = m.WireScope.of(scope)
        n = int(pages.shape[0])
        bs = self.layout.block_size
        stored = skipped = 0
        durable = True
        off = 0
        while True:
            slots = self._stage(min(self.stage_quota, n - off)) if n > off else []
            k = len(slots)
            try:
                self._write_staging(slots, pages[off : off + k])
            except BaseException:
                self._transport.call(Op.UNSTAGE, m.Unstage(tuple(slots)))
                raise
            end = len(arr) if k == 0 else min(len(arr), (start_block + off + k) * bs)
            r = self._transport.call(Op.COMMIT, m.Commit(ws, arr[:end], tuple(slots), start_block + off,
                                               block_extra, int(priority)))
            stored += int(r["stored"])
            skipped += int(r["skipped"])
            durable = durable and bool(r["durable"])
            off += k
            if off >= n:
                return PutResult(stored, skipped, durable)

    def _stage(self, want: int) -> list[int]:
        """Up to ``want`` staging slots: fewer when the shared region is busy, waiting (up
        to the client timeout) when none is free. CapacityError if none frees up."""
        deadline = time.monotonic() + self.timeout
        backoff = Backoff(0.001, 0.05)
        while True:
            try:
                return [int(s) for s in self._transport.call(Op.STAGE, m.Stage(want))["slots"]]
            except CapacityError:
                if want > 1:
                    want //= 2
                    continue
                if time.monotonic() + backoff.delay_s > deadline:
                    raise
                time.sleep(backoff.failed())

    def _write_staging(self, slots: list[int], pages: torch.Tensor) -> None:
        if not slots:
            return
        if any(not 0 <= s < self.staging_pool.shape[0] for s in slots):
            raise ProtocolError("daemon returned staging slots outside the staging region")
        if slots == list(range(slots[0], slots[0] + len(slots))):
            self.staging_pool[slots[0] : slots[0] + len(slots)].copy_(pages)
        else:
            for i, s in enumerate(slots):
                self.staging_pool[s].copy_(pages[i])

    def prefetch(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                 block_extra: Sequence[Sequence[str | bytes]] | None = None) -> Future:
        """Future of the number of tokens now warm on the device tier (nothing stays leased)."""
        self._transport.check_open()
        req = self._req(tokens, scope, block_extra)
        with self._prefetch_lock:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="tierkv-client-prefetch")
        return self._prefetcher.submit(lambda: int(self._transport.call(Op.PREFETCH, req)["tokens_warm"]))

    # ---- operations ----------------------------------------------------------------------------
    def set_priority(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, priority: Priority) -> int:
        req = m.SetPriority(m.WireScope.of(scope), as_token_array(tokens), int(priority))
        return int(self._transport.call(Op.SET_PRIORITY, req)["count"])

    def set_priority_from(self, last_key: bytes, priority: Priority) -> int:
        """Same as :meth:`Store.set_priority_from`: the chain ending at ``last_key``."""
        return int(self._transport.call(Op.SET_PRIORITY_FROM, m.ChainRef(bytes(last_key), int(priority)))["count"])

    def chain_tokens(self, last_key: bytes) -> ChainTokens:
        """Same as :meth:`Store.chain_tokens`: token ids, model version and namespace of the
        stored chain ending at ``last_key``; NotFoundError when it is not stored."""
        f = self._transport.call_frame(Op.CHAIN_TOKENS, m.ChainRef(bytes(last_key)))
        h = f.header
        if not isinstance(h.get("model_version"), str) or not isinstance(h.get("namespace"), str):
            raise ProtocolError("chain_tokens reply lacks model_version or namespace")
        return ChainTokens(m.tokens_from(f.payload).copy(), h["model_version"], h["namespace"])

    def chain_residency(self, last_key: bytes) -> Residency:
        """Same as :meth:`Store.chain_residency`: blocks of the chain in each tier."""
        r = self._transport.call(Op.CHAIN_RESIDENCY, m.ChainRef(bytes(last_key)))["residency"]
        try:
            return Residency.from_dict(r)
        except (KeyError, TypeError, ValueError):
            raise ProtocolError("chain_residency reply is malformed") from None

    def save_manifest(self, name: str, manifest: dict) -> None:
        self._transport.call(Op.SAVE_MANIFEST, m.ManifestRequest(name, manifest))

    def get_manifest(self, name: str) -> dict:
        return self._transport.call(Op.GET_MANIFEST, m.ManifestRequest(name))["manifest"]

    def list_manifests(self) -> dict[str, dict]:
        return self._transport.call(Op.LIST_MANIFESTS, m.Empty())["manifests"]

    def delete_manifest(self, name: str) -> bool:
        return bool(self._transport.call(Op.DELETE_MANIFEST, m.ManifestRequest(name))["deleted"])

    def invalidate(self, *, model_version: str | None = None, namespace: str | None = None,
                   dry_run: bool = False) -> InvalidateResult:
        r = self._transport.call(Op.INVALIDATE, m.Invalidate(model_version, namespace, dry_run))
        return InvalidateResult(int(r["removed_blocks"]), int(r["freed_bytes"]), bool(r["dry_run"]))

    def gc(self, keep_model_versions: Sequence[str] = (), keep_namespaces: Sequence[str] = (),
           dry_run: bool = False) -> GcResult:
        """``tierkv.gc.collect`` run by the daemon over every store it serves (GC): every
        tenant's named prefixes are kept. NotPermittedError for a tenant under
        ``namespace_per_uid``."""
        f = self._transport.call_frame(Op.GC, m.Gc(tuple(keep_model_versions), tuple(keep_namespaces), dry_run))
        try:
            return GcResult.from_dict(json.loads(f.payload))
        except (ValueError, KeyError, TypeError) as e:
            raise ProtocolError(f"gc reply is malformed: {e}") from None

    def verify(self, repair: bool = False) -> VerifyResult:
        r = self._transport.call(Op.VERIFY, m.Verify(repair))
        return VerifyResult(int(r["checked"]), tuple(r["corrupt"]), bool(r["repaired"]),
                            tuple(str(k) for k in r.get("unreadable", ())))

    def stats(self, namespace_limit: int | None = None, namespace_after: str | None = None) -> StoreStats:
        namespace_page({}, namespace_limit, namespace_after)  # ValueError on a bad limit, as the Store's
        f = self._transport.call_frame(Op.STATS, m.Stats(namespace_limit, namespace_after))
        if f.header.get("format") != "json":
            raise ProtocolError("stats reply without its JSON payload")
        try:
            d = json.loads(f.payload)
        except ValueError as e:
            raise ProtocolError(f"stats reply payload is not JSON: {e}") from None
        return StoreStats.from_dict(d)

    def ping(self) -> None:
        self._transport.call(Op.PING, m.Empty())

    def remove_layout(self, layout_id: str) -> RemoveLayoutResult:
        """Remove the store of a layout the daemon serves (REMOVE_LAYOUT; LayoutInUseError
        while a connection uses it, NotFoundError when it serves none by that id)."""
        r = self._transport.call(Op.REMOVE_LAYOUT, m.LayoutRef(layout_id))
        return RemoveLayoutResult(layout_id, int(r["removed_blocks"]), int(r["freed_bytes"]))

    def check_integrity(self) -> None:
        """Client-side state (connected, no settled reply left waiting, leases consistent), then the daemon's
        stores (CHECK_INTEGRITY); AssertionError naming the first mismatch. A tenant under
        ``namespace_per_uid`` may not check every tenant's store: the daemon is then only
        pinged."""
        self._transport.check_integrity()
        assert all(not le.released and le.store is self for le in self._leases.values()), "released lease tracked"
        try:
            error = self._transport.call(Op.CHECK_INTEGRITY, m.Empty()).get("error")
        except NotPermittedError:
            self.ping()
            return
        assert error is None, f"the daemon's store: {error}"

    def close(self) -> None:
        """Disconnect; the daemon releases every lease this client still holds."""
        if self._transport.closed:
            return
        self._transport.close()
        for lease in self._leases.values():
            lease.released = True
        self._leases.clear()
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=False)
        for r in self._regions:
            r.close()
        self._regions.clear()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
