"""A store that also reads and writes the cluster-wide remote tier.

:class:`ClusterNode` wraps an embedded :class:`~tierkv.store.Store` through its public API
(docs/cluster.md, "How ClusterNode sits on the store"). ``lookup`` counts the blocks beyond the
local prefix that the remote tier holds (one batched existence check); ``acquire`` first
*pulls* them: fetches, verifies against the request (key, model version, namespace,
parent, token ids, page checksum), ``put``s them into the local store, then serves the
lease locally, so pages always reach the caller from the device tier as usual. Pages are
published to the remote tier by :class:`~tierkv.cluster.publisher.Publisher` (the write
path), as :class:`~tierkv.cluster.publish_policy.PublishPolicy` says.

Remote faults never reach a request: the remote tier answers "miss" while it is down, and
a local error while storing fetched pages only costs the pages (counted, logged).
It implements :class:`~tierkv.api.StoreAPI`; the methods the remote tier does not change
delegate to the store explicitly. With ``write_back_evicted`` its publisher listens to the
store's evictions (:meth:`Store.add_eviction_listener`) and publishes a block leaving its
last local tier.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Sequence

import numpy as np
import torch

from ..api import StoreAPI
from ..blocks import Priority
from ..errors import TierKVError
from ..identity import Scope, as_token_array
from ..results import (
    ChainTokens, InvalidateResult, Lease, LookupResult, PutResult, Residency, StoreStats, VerifyResult,
)
from ..store import Store
from .remote import RemoteMeta, RemotePutResult, RemoteTier
from .publish_policy import Event, PublishPolicy
from .publisher import Publisher

log = logging.getLogger(__name__)
REMOTE = "remote"


@dataclass(frozen=True)
class PullResult:
    local_blocks: int  # blocks of the prefix this node already held
    remote_blocks: int  # blocks fetched, verified and stored locally by this call
    fetched_bytes: int
    seconds: float


class ClusterNode(StoreAPI):
    """A store plus the remote tier. Owns both: :meth:`close` closes both."""

    def __init__(self, store: Store, remote: RemoteTier | None, policy: PublishPolicy | None = None) -> None:
        if remote is not None and remote.layout != store.layout:
            raise ValueError("the remote tier and the store must use the same page layout")
        if remote is not None and not store.disk.codec.exact:
            # Evicted blocks would reach the remote tier in the codec's stored form, which its
            # objects (exact pages, checked against their checksum) do not carry.
            raise ValueError(f"the remote tier needs exact pages; this store's page codec is {store.disk.codec.name!r}")
        self.store = store
        self.remote = remote
        self.policy = policy if policy is not None else PublishPolicy()
        self.layout = store.layout
        self.counters: Counter[str] = Counter()
        self._counters_lock = threading.Lock()
        self._prefetcher: ThreadPoolExecutor | None = None
        self._prefetch_lock = threading.Lock()
        # The write path (and, with write_back_evicted, the store's eviction listener).
        self.publisher = Publisher(store, remote, self.policy, self._count) if remote is not None else None

    # ---- read path -----------------------------------------------------------------------
    def _remote_for(self, scope: Scope) -> RemoteTier | None:
        if self.remote is None or not self.policy.fetches(scope.namespace) or not self.remote.available:
            return None
        return self.remote

    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
               block_extra: Sequence[Sequence[str | bytes]] | None = None) -> LookupResult:
        """The local lookup, extended by the blocks right after it that the remote tier
        holds (their tier is "remote"). Existence only: pages are checked when fetched."""
        arr = as_token_array(tokens)
        local = self.store.lookup(arr, scope, block_extra)
        remote = self._remote_for(scope)
        if remote is None:
            return local
        # The store's keys of the prompt: those its lookup just computed are not hashed again.
        rest = self.store.block_keys(arr, scope, block_extra=block_extra)[local.num_blocks :]
        n = _leading(remote.exists(rest))
        if not n:
            return local
        self._count("lookup_remote_blocks", n)
        return LookupResult((local.num_blocks + n) * self.layout.block_size, local.keys + tuple(rest[:n]),
                            local.tiers + (REMOTE,) * n)

    def pull(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
             block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None) -> PullResult:
        """Fetch the blocks beyond the local prefix from the remote tier into the local store."""
        t0 = time.perf_counter()
        arr = as_token_array(tokens)
        local = self.store.lookup(arr, scope, block_extra)
        n_local = local.num_blocks
        remote = self._remote_for(scope)
        if remote is None:
            return PullResult(n_local, 0, 0, time.perf_counter() - t0)
        bs = self.layout.block_size
        keys = self.store.block_keys(arr, scope, block_extra=block_extra)  # remembered: the put below hashes none
        limit = len(keys) if max_blocks is None else min(len(keys), max_blocks)
        rest = keys[n_local:limit]
        n = _leading(remote.exists(rest))
        expect = [
            RemoteMeta(key=keys[i], parent=keys[i - 1] if i else scope.seed, model_version=scope.model_version,
                       namespace=scope.namespace, tokens=arr[i * bs : (i + 1) * bs].tobytes(), checksum=0)
            for i in range(n_local, n_local + n)
        ]
        got = remote.get_pages(rest[:n], expect) if n else []
        if not got:
            return PullResult(n_local, 0, 0, time.perf_counter() - t0)
        pages = torch.stack([p.page for p in got])
        try:
            self.store.put(arr[: (n_local + len(got)) * bs], pages, scope, start_block=n_local,
                           block_extra=block_extra, priority=self.policy.promote_priority)
        except TierKVError as e:
            self._count("promote_failed")
            log.warning("storing %d fetched blocks failed: %s", len(got), e)
            return PullResult(n_local, 0, 0, time.perf_counter() - t0)
        self._count("pulled_blocks", len(got))
        return PullResult(n_local, len(got), len(got) * self.layout.page_bytes, time.perf_counter() - t0)

    def acquire(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None,
                start_block: int = 0, promote: bool = True) -> Lease:
        """:meth:`Store.acquire` after a :meth:`pull` of what the remote tier holds (up to
        the end of the window ``start_block .. start_block + max_blocks``)."""
        if start_block < 0:
            raise ValueError("start_block must be >= 0")
        self.pull(tokens, scope, block_extra, None if max_blocks is None else start_block + max_blocks)
        return self.store.acquire(tokens, scope, block_extra, max_blocks, start_block, promote)

    def prefetch(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                 block_extra: Sequence[Sequence[str | bytes]] | None = None) -> Future[int]:
        """:meth:`Store.prefetch` that pulls from the remote tier first, in the background;
        the future gives the number of tokens now warm. Nothing stays leased."""
        arr = as_token_array(tokens)

        def run() -> int:
            with self.acquire(arr, scope, block_extra) as lease:
                return lease.tokens_matched

        with self._prefetch_lock:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="tierkv-cluster-prefetch")
            return self._prefetcher.submit(run)

    # ---- write path ------------------------------------------------------------------------
    def put(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, pages: torch.Tensor, scope: Scope, *,
            start_block: int = 0, block_extra: Sequence[Sequence[str | bytes]] | None = None,
            priority: Priority = Priority.NORMAL) -> PutResult:
        """:meth:`Store.put`, then publish the pages when the policy wants them."""
        result = self.store.put(tokens, pages, scope, start_block=start_block, block_extra=block_extra,
                                priority=priority)
        if self.publisher is not None:
            self.publisher.publish_put(tokens, pages, scope, start_block, block_extra, priority)
        return result

    def set_priority(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, priority: Priority) -> int:
        changed = int(self.store.set_priority(tokens, scope, priority))
        if priority == Priority.PINNED and self.policy.wants(Event.PINNED, scope.namespace):
            self.publish_prefix(tokens, scope)
        return changed

    def save_manifest(self, name: str, manifest: dict) -> None:
        """Record the manifest locally, then publish the named prefix's blocks (write-through
        for materialised prefixes). The manifest itself stays local."""
        self.store.save_manifest(name, manifest)
        if self.publisher is not None:
            self.publisher.publish_manifest(name, manifest)

    def republish(self) -> int:
        """Publish every named prefix the policy publishes, again: a restarted master has lost
        every object. Objects still there are skipped. Returns the blocks written."""
        return self.publisher.republish() if self.publisher is not None else 0

    def publish_prefix(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                       block_extra: Sequence[Sequence[str | bytes]] | None = None,
                       window: int = 64) -> RemotePutResult:
        """Publish the locally cached prefix of ``tokens`` (:meth:`Publisher.publish_prefix`)."""
        if self.publisher is None:
            return RemotePutResult(0, 0, 0)
        return self.publisher.publish_prefix(tokens, scope, block_extra, window)

    def evicted(self, meta: RemoteMeta, page: torch.Tensor, priority: Priority = Priority.NORMAL) -> bool:
        """The eviction hook (:meth:`Publisher.evicted`): whether the block was published."""
        return self.publisher is not None and self.publisher.evicted(meta, page, priority)

    def _count(self, name: str, n: int = 1) -> None:
        with self._counters_lock:
            self.counters[name] += n

    # ---- the rest of StoreAPI: the remote tier does not change these -----------------------------
    def release(self, lease: Lease) -> None:
        self.store.release(lease)

    def set_priority_from(self, last_key: bytes, priority: Priority) -> int:
        return self.store.set_priority_from(last_key, priority)

    def block_keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, n_blocks: int | None = None,
                   block_extra: Sequence[Sequence[str | bytes]] | None = None) -> list[bytes]:
        return self.store.block_keys(tokens, scope, n_blocks, block_extra)

    def chain_tokens(self, last_key: bytes) -> ChainTokens:
        return self.store.chain_tokens(last_key)

    def chain_residency(self, last_key: bytes) -> Residency:
        """Local residency only: the remote tier is a cache shared by nodes, not this node's."""
        return self.store.chain_residency(last_key)

    def get_manifest(self, name: str) -> dict[str, Any]:
        return self.store.get_manifest(name)

    def list_manifests(self) -> dict[str, dict[str, Any]]:
        return self.store.list_manifests()

    def delete_manifest(self, name: str) -> bool:
        return self.store.delete_manifest(name)

    def invalidate(self, *, model_version: str | None = None, namespace: str | None = None,
                   dry_run: bool = False) -> InvalidateResult:
        """The local blocks, and the remote tier's copies of them (counted in
        ``cluster.invalidated_remote``); the result counts the local blocks.

        What stays in the remote tier: objects of blocks this node does not hold (published
        by another node, or by this one before it evicted them). An object is named by its
        block key alone, and finding the others would mean listing every object of the
        cluster, which the remote tier's client does not offer. So a later request here may
        pull such a copy back (verified as always: the same model version, namespace and
        token ids). To remove a model version or namespace from the whole cluster, run the
        invalidation on every node: each removes the copies of what it holds; objects that
        no node holds stay until the remote store evicts them. A remote tier that is down
        keeps its copies (the local invalidation goes on; nothing is retried)."""
        remote = self.remote
        keys: list[bytes] = []
        if (not dry_run and remote is not None and remote.available
                and (namespace is None or self.policy.fetches(namespace))):  # local-only: never published
            keys = self.store.keys_of(model_version=model_version, namespace=namespace)
        r = self.store.invalidate(model_version=model_version, namespace=namespace, dry_run=dry_run)
        if keys:
            assert remote is not None
            self._count("invalidated_remote", remote.remove_pages(keys))
        return r

    def verify(self, repair: bool = False) -> VerifyResult:
        return self.store.verify(repair)

    # ---- operations --------------------------------------------------------------------------
    def stats(self, namespace_limit: int | None = None, namespace_after: str | None = None) -> StoreStats:
        """The store's stats, plus ``cluster`` (this node's pull/publish counters),
        ``remote`` (the remote tier's own stats) and ``tiers.remote`` (its state and main
        counters, see :meth:`remote_summary`); lookup hits in the remote tier are counted
        under ``hits.remote``."""
        s = self.store.stats(namespace_limit, namespace_after)
        with self._counters_lock:
            cluster = dict(self.counters)
        if self.remote is None:
            return replace(s, cluster=cluster, remote=None)
        c = s.counters
        n = cluster.get("lookup_remote_blocks", 0)
        counters = replace(c, hits={**c.hits, REMOTE: n},
                           hit_rate_by_tier={**c.hit_rate_by_tier, REMOTE: n / c.lookup_blocks if c.lookup_blocks else 0.0})
        return replace(s, counters=counters, cluster=cluster, remote=self.remote.stats(),
                       remote_tier=self.remote_summary())

    def remote_summary(self) -> dict[str, object]:
        """The remote tier at a glance: ``state`` is "up", "degraded" (down after a fault;
        ``degraded_reason`` says which, and requests are served locally meanwhile) or
        "connecting" (no call made yet)."""
        assert self.remote is not None
        r = self.remote.stats()
        faults = dict(r.get("faults") or {})  # type: ignore[call-overload]
        up = bool(r.get("up"))
        if up:
            state = "up"
        elif faults or r.get("connects"):
            state = "degraded"
        else:
            state = "connecting"
        with self._counters_lock:
            pulled, published = self.counters["pulled_blocks"], self.counters["published_blocks"]
        return {
            "state": state, "available": up, "degraded_reason": None if up else (r.get("last_fault") or None),
            "master": r.get("master"), "key_prefix": r.get("key_prefix"),
            "hits": int(r.get("hits", 0)), "fetched_bytes": int(r.get("fetched_bytes", 0)),
            "misses": int(r.get("misses", 0)), "verify_failures": int(faults.get("verify_failed", 0)),
            "connects": int(r.get("connects", 0)), "reconnects": int(r.get("reconnects", 0)),
            "published": int(r.get("published", 0)), "published_bytes": int(r.get("published_bytes", 0)),
            "publish_failed": int(r.get("publish_failed", 0)), "pulled_blocks": pulled,
            "published_blocks": published, "faults": faults,
        }

    def check_integrity(self) -> None:
        self.store.check_integrity()
        if self.remote is not None:
            self.remote.check_integrity()

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
        if self.publisher is not None:
            self.publisher.close()  # queued write-backs read nothing from the store: before its close
        try:
            self.store.close()
        finally:
            if self.remote is not None:
                self.remote.close()

    def __enter__(self) -> "ClusterNode":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _leading(flags: Sequence[bool]) -> int:
    n = 0
    for f in flags:
        if not f:
            break
        n += 1
    return n
