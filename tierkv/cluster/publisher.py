"""Writing a node's pages to the remote tier: the write path of
:class:`~tierkv.cluster.node.ClusterNode`, as its :class:`~tierkv.cluster.publish_policy.PublishPolicy`
says.

:class:`Publisher` publishes a put's pages, a locally cached prefix (leased a window at a
time), the blocks of named prefixes (again after a master restart: ``republish``), and, with
``write_back_evicted``, blocks leaving the node's last tier. Evicted blocks reach it through
the store's eviction listener, under the store lock with a copy of the page; the remote
write runs on a one-thread executor this class owns, never under that lock. A remote tier
that is down makes a publish count as failed, never an error for the request.
"""
from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

import numpy as np
import torch

from ..blocks import Priority
from ..checksum import page_checksum
from ..errors import TierKVError
from ..eviction import EvictedBlock
from ..identity import Scope, as_token_array
from ..store import Store
from .publish_policy import Event, PublishPolicy
from .remote import RemoteMeta, RemotePutResult, RemoteTier

log = logging.getLogger(__name__)
_NONE = RemotePutResult(0, 0, 0)


class Publisher:
    """Publishes ``store``'s pages to ``remote``; ``count(name, n)`` adds to the node's
    counters (``published_blocks``, ``written_back_blocks``). Owns the write-back thread:
    :meth:`close` finishes what is queued and stops it."""

    def __init__(self, store: Store, remote: RemoteTier, policy: PublishPolicy,
                 count: Callable[[str, int], None]) -> None:
        self.store = store
        self.remote = remote
        self.policy = policy
        self.layout = store.layout
        self._count = count
        self._writer: ThreadPoolExecutor | None = None
        if policy.write_back_evicted:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="tierkv-cluster-publish")
            store.add_eviction_listener(self._on_evicted, self._wants_evicted)

    # ---- what the node asks for ------------------------------------------------------------
    def publish_put(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, pages: torch.Tensor, scope: Scope,
                    start_block: int,
                    block_extra: Sequence[Sequence[str | bytes]] | None, priority: Priority) -> RemotePutResult:
        """The pages of a put just stored (blocks ``start_block ..``), when the policy
        publishes puts of this namespace and priority."""
        if not self.policy.wants(Event.PUT, scope.namespace, priority):
            return _NONE
        arr = as_token_array(tokens)
        # The keys the put just computed, from the store's chain memo: not hashed again.
        keys = self.store.block_keys(arr, scope, start_block + int(pages.shape[0]), block_extra)
        return self.publish(arr, keys, scope, start_block, pages)

    def publish_manifest(self, name: str, manifest: dict) -> RemotePutResult:
        """Publish the blocks of a named prefix when the policy publishes materialised (or,
        for a pinned one, pinned) prefixes; nothing when its chain is incomplete here."""
        last = manifest.get("last_block_key")
        if not isinstance(last, str) or not last:
            return _NONE
        try:
            tokens, mv, ns = self.store.chain_tokens(bytes.fromhex(last))
        except (TierKVError, ValueError) as e:
            log.warning("prefix %r not published: %s", name, e)
            return _NONE
        scope = Scope(mv, ns, tuple(manifest.get("extra_keys", ())))
        pinned = bool(manifest.get("pinned")) and self.policy.wants(Event.PINNED, ns)
        if not (self.policy.wants(Event.MATERIALISED, ns) or pinned):
            return _NONE
        keys = self.store.block_keys(tokens, scope)  # remembered: publish_prefix below hashes none
        if not keys or keys[-1].hex() != last:
            log.warning("prefix %r not published: its chain is incomplete on this node", name)
            return _NONE
        return self.publish_prefix(tokens, scope)

    def republish(self) -> int:
        """Publish every named prefix the policy publishes, again (a restarted master has
        lost every object; objects still there are skipped). Returns the blocks written."""
        return sum(self.publish_manifest(name, m).published for name, m in self.store.list_manifests().items())

    def publish_prefix(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                       block_extra: Sequence[Sequence[str | bytes]] | None = None,
                       window: int = 64) -> RemotePutResult:
        """Publish the locally cached prefix of ``tokens``, leased ``window`` blocks at a
        time (so a prefix larger than the device tier is published whole)."""
        if scope.namespace in self.policy.local_only_namespaces:
            return _NONE
        arr = as_token_array(tokens)
        keys = self.store.block_keys(arr, scope, block_extra=block_extra)
        published = skipped = failed = start = 0
        while start < len(keys):
            with self.store.acquire(arr, scope, block_extra, max_blocks=window, start_block=start) as lease:
                if not lease.num_blocks:
                    break
                r = self.publish(arr, keys, scope, start, lease.pages().cpu())
                start += lease.num_blocks
            published, skipped, failed = published + r.published, skipped + r.skipped, failed + r.failed
        return RemotePutResult(published, skipped, failed)

    def publish(self, arr: np.ndarray, keys: list[bytes], scope: Scope, start: int,
                pages: torch.Tensor) -> RemotePutResult:
        """``pages`` as the remote objects of blocks ``start ..`` of ``keys`` (the chain of
        ``arr`` under ``scope``), each with its metadata and page checksum."""
        bs = self.layout.block_size
        n = int(pages.shape[0])
        metas = [
            RemoteMeta(key=keys[i], parent=keys[i - 1] if i else scope.seed, model_version=scope.model_version,
                       namespace=scope.namespace, tokens=arr[i * bs : (i + 1) * bs].tobytes(),
                       checksum=page_checksum(keys[i], pages[i - start]))
            for i in range(start, start + n)
        ]
        result = self.remote.put_pages(keys[start : start + n], pages, metas)
        self._count("published_blocks", result.published)
        return result

    # ---- blocks leaving the node's last tier ---------------------------------------------
    def evicted(self, meta: RemoteMeta, page: torch.Tensor, priority: Priority = Priority.NORMAL) -> bool:
        """A block is leaving this node's last tier: published when the policy has
        ``write_back_evicted``; returns whether it was."""
        if not self.policy.wants(Event.EVICTED, meta.namespace, priority):
            return False
        return self.remote.put_pages([meta.key], page.unsqueeze(0), [meta]).failed == 0

    def _wants_evicted(self, namespace: str, priority: Priority) -> bool:
        return self.policy.wants(Event.EVICTED, namespace, priority)

    def _on_evicted(self, block: EvictedBlock) -> None:
        """The store's eviction listener (under the store lock, with a copy of the page):
        queues the write, which runs on this publisher's thread."""
        writer = self._writer
        if writer is None:
            return
        meta = RemoteMeta(key=block.key, parent=block.parent, model_version=block.model_version,
                          namespace=block.namespace, tokens=block.tokens, checksum=block.checksum)
        try:
            writer.submit(self._write_back, meta, block.page, block.priority)
        except RuntimeError:  # closing
            pass

    def _write_back(self, meta: RemoteMeta, page: torch.Tensor, priority: Priority) -> None:
        if self.evicted(meta, page, priority):
            self._count("written_back_blocks", 1)

    def flush(self) -> None:
        """Wait for the write-backs queued so far."""
        writer = self._writer
        if writer is not None:
            writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the queued write-backs and stop the thread (before the store closes)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)
