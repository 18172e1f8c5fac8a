"""Store operations: pinning, named manifests, invalidation, scrubbing and statistics.

:class:`StoreOperations` is given the store's :class:`~tierkv.core.placement.Placement`: it reads
the block table, tiers and index under the placement's lock, and changes blocks only through
the placement (``retire``, ``quarantine``, ``flush_to_disk``). :class:`~tierkv.core.store.Store`
checks that it is usable (open, same process) before it calls any of these.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from .blocks import TIERS, Block, Priority
from ..checksum import page_checksum
from ..errors import NotFoundError, TierKVError
from ..manifest_names import check_name
from ..identity import as_token_array
from .matching import match_chain
from .placement import Placement
from ..results import (ChainTokens, CounterStats, InvalidateResult, Residency, StoreStats, TierStats, VerifyResult,
                       namespace_page)
from ..tiers import TierName

if TYPE_CHECKING:
    from ..identity import Scope

log = logging.getLogger(__name__)
DEVICE, HOST, DISK = TierName.DEVICE, TierName.HOST, TierName.DISK


class StoreOperations:
    """The store's operations other than reads and writes of pages."""

    def __init__(self, placement: Placement) -> None:
        self.placement = placement
        # The placement's parts, bound once (they never change).
        self.config, self.layout, self.table = placement.config, placement.layout, placement.table
        self.index, self.stats_counters, self._lock = placement.index, placement.stats_counters, placement.lock
        self.device, self.host, self.disk = placement.device, placement.host, placement.disk

    def set_priority(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, priority: Priority) -> int:
        """Set the priority of the cached prefix of ``tokens`` (pin/unpin); returns the
        number of blocks changed. Pinned blocks are written to disk if they are not yet."""
        arr = as_token_array(tokens)
        with self._lock:
            chain = match_chain(self.placement, arr, scope, None)
            return self._set_priority_blocks(chain, priority)

    def set_priority_from(self, last_key: bytes, priority: Priority) -> int:
        """Same as :meth:`set_priority` for the chain ending at ``last_key`` (from a manifest)."""
        with self._lock:
            chain: list[Block] = []
            b = self.table.get(last_key)
            while b is not None:
                chain.append(b)
                b = self.table.get(b.parent)
            return self._set_priority_blocks(chain[::-1], priority)

    def _set_priority_blocks(self, chain: list[Block], priority: Priority) -> int:
        records = []
        for b in chain:
            self.table.set_priority(b, priority)
            if DISK in b.loc:
                records.append(self.placement.record(b, b.loc[DISK]))
            elif priority == Priority.PINNED:
                self.placement.flush_to_disk(b)  # write-through for pinned prefixes
        if records:
            self.index.put_blocks(records)
            # The slot records too, so that a rebuilt index keeps the pins (tierkv.repair).
            self.disk.update_records([(r.disk_loc, r.slot_body()) for r in records])
        return len(chain)

    def save_manifest(self, name: str, manifest: dict) -> None:
        """Record a named prefix (JSON-able dict) durably. InvalidNameError for a name
        tierkv.manifest_names refuses."""
        check_name(name)
        self.index.put_manifest(name, manifest)

    def get_manifest(self, name: str) -> dict:
        m = self.index.get_manifest(name)
        if m is None:
            known = ", ".join(sorted(self.index.list_manifests())) or "none"
            raise NotFoundError(f"no prefix named {name!r} (known: {known})")
        return m

    def list_manifests(self) -> dict[str, dict]:
        return self.index.list_manifests()

    def delete_manifest(self, name: str) -> bool:
        return self.index.delete_manifest(name)

    def chain_residency(self, last_key: bytes) -> Residency:
        """Blocks of the chain ending at ``last_key``, and how many each tier holds."""
        with self._lock:
            counts = {t: 0 for t in TIERS}
            blocks = 0
            b = self.table.get(last_key)
            while b is not None:
                blocks += 1
                for t in b.tiers:
                    counts[t] += 1
                b = self.table.get(b.parent)
            return Residency(blocks, counts[DEVICE], counts[HOST], counts[DISK])

    def chain_tokens(self, last_key: bytes) -> ChainTokens:
        """Token ids, model version and namespace of the stored chain ending at ``last_key``
        (for export, and for pinning a named prefix). Raises NotFoundError when any block of
        the chain is missing."""
        with self._lock:
            parts: list[bytes] = []
            b = self.table.get(last_key)
            if b is None:
                raise NotFoundError(f"block {last_key.hex()[:16]} is not stored")
            mv, ns = b.model_version, b.namespace
            while b is not None:
                parts.append(b.tokens)
                prev = b.parent
                b = self.table.get(prev)
            # The walk ends at the scope seed; a missing middle block would end it early,
            # which the caller detects by re-keying the tokens (the last key must match).
            return ChainTokens(np.frombuffer(b"".join(reversed(parts)), dtype="<i4").copy(), mv, ns)

    # ---- operations ------------------------------------------------------------------
    def invalidate(self, *, model_version: str | None = None, namespace: str | None = None,
                   dry_run: bool = False) -> InvalidateResult:
        """Remove every block of ``model_version`` and/or ``namespace`` from every tier.
        Leased blocks become unreachable at once and are freed when their lease ends.
        Idempotent; segments left empty are deleted (disk space returned)."""
        if model_version is None and namespace is None:
            raise ValueError("invalidate needs model_version or namespace")
        with self._lock:
            victims = [
                b for b in self.table.blocks.values()
                if (model_version is None or b.model_version == model_version)
                and (namespace is None or b.namespace == namespace)
            ]
            place = self.placement  # bytes as stored (a page codec's host and disk pages are smaller)
            size = sum(place.disk.slot_bytes if t == DISK else place.tier(t).page_bytes for b in victims for t in b.loc)
            if dry_run:
                return InvalidateResult(len(victims), size, dry_run=True)
            # One index transaction for all (index first), then the slots.
            self.index.delete_blocks(b.key for b in victims if DISK in b.loc)
            for b in victims:
                self.placement.retire(b, index_done=True)
        return InvalidateResult(len(victims), size)

    def verify(self, repair: bool = False) -> VerifyResult:
        """Re-read and checksum every disk page; with ``repair`` quarantine the bad ones.

        Only a checksum mismatch or a slot its segment provably lacks makes a page corrupt.
        A page that cannot be read (an I/O error) is reported as unreadable, never
        quarantined: the error says nothing about the page (docs/operations.md)."""
        with self._lock:
            targets = [(b, b.loc[DISK]) for b in self.table.blocks.values() if DISK in b.loc]
            for b, _ in targets:
                self.table.holds.busy(b)
        bad: list[Block] = []
        unreadable: list[tuple[Block, OSError]] = []
        try:
            for b, loc in targets:
                try:
                    ok = page_checksum(b.key, self.disk.read_page(loc)) == b.checksum
                except OSError as e:
                    if not self.disk.page_missing(loc):
                        unreadable.append((b, e))
                        continue
                    ok = False
                if not ok:
                    bad.append(b)
        finally:
            with self._lock:
                for b, _ in targets:
                    self.placement.unbusy(b)  # frees blocks invalidated while they were being read
                for _, e in unreadable:
                    self.disk.note_read_error(e)
                if targets and not unreadable:
                    self.disk.note_read_ok()
                if repair:
                    for b in bad:
                        if not b.dead:
                            self.placement.quarantine(b, "page checksum mismatch or page missing (verify)")
        return VerifyResult(len(targets), tuple(b.key.hex() for b in bad), repair,
                            unreadable=tuple(b.key.hex() for b, _ in unreadable))

    def pinned_blocks(self, namespace_prefix: str = "") -> int:
        """Pinned blocks whose namespace starts with ``namespace_prefix`` (the daemon's
        per-tenant pinned quota; pinned blocks never leave the disk tier). O(blocks)."""
        with self._lock:
            return sum(1 for b in self.table.blocks.values()
                       if b.priority == Priority.PINNED and b.namespace.startswith(namespace_prefix))

    def stats(self, namespace_limit: int | None = None, namespace_after: str | None = None) -> StoreStats:
        """Per-tier occupancy and counters (``as_dict()`` is the JSON shape); ``namespaces``
        paged as :meth:`tierkv.api.StoreAPI.stats` says (all of them by default)."""
        with self._lock:
            tiers = {
                t.value: TierStats(tier.slots.num_used, tier.used_bytes, tier.capacity_bytes, tier.describe())
                for t, tier in ((DEVICE, self.device), (HOST, self.host))
            }
            tiers[DISK.value] = TierStats(self.disk.num_used, self.disk.used_bytes, self.disk.capacity_bytes,
                                          self.disk.describe())
            by_mv: dict[str, int] = {}
            by_ns: dict[str, int] = {}
            for b in self.table.blocks.values():
                by_mv[b.model_version] = by_mv.get(b.model_version, 0) + 1
                by_ns[b.namespace] = by_ns.get(b.namespace, 0) + 1
            page, next_ns = namespace_page(by_ns, namespace_limit, namespace_after)
            return StoreStats(
                home=str(self.config.home), layout=self.layout.to_dict(), blocks=len(self.table),
                leased_blocks=sum(1 for b in self.table.blocks.values() if b.leases), tiers=tiers,
                disk_read_path=self.disk.read_path, model_versions=by_mv, namespaces=page, namespaces_next=next_ns,
                counters=CounterStats.from_dict({**self.stats_counters.as_dict(), **self.table.policy_stats()}),
                index_resizes=self.index.resizes, stale_readers_cleared=self.index.stale_readers_cleared,
            )

    def flush_all(self) -> int:
        """Write-back at close (held: the lock); returns how many blocks stayed memory-only."""
        lost = 0
        for b in list(self.table.blocks.values()):
            if DISK in b.loc or b.priority == Priority.EPHEMERAL or b.dead:
                continue
            try:
                ok = self.placement.flush_to_disk(b)
            except TierKVError as e:
                log.error("close: writing block %s to disk failed: %s", b.key.hex()[:16], e)
                ok = False
            lost += not ok
        self.stats_counters.unflushed_at_close = lost
        if lost:
            log.error("close: %d memory-only block(s) could not be written to disk (disk degraded: %s)",
                      lost, self.disk.degraded_reason)
        return lost
