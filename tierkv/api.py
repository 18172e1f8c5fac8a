"""The store contract: what :class:`~tierkv.store.Store` (embedded), the daemon client
(:class:`~tierkv.daemon.client.Client`, from :func:`tierkv.connect`) and
:class:`~tierkv.cluster.node.ClusterNode` all offer, with the same results and errors.

Callers (the CLI, :mod:`tierkv.transfer`, :mod:`tierkv.gc`, :mod:`tierkv.materialize`, the
transformers and vLLM integrations) take a ``StoreAPI`` and never branch on which one they
hold; ``tests/conformance/`` runs the same scenarios against all three.

Implementations subclass this Protocol explicitly. The bodies here raise
NotImplementedError, so a method an implementation forgot fails loudly instead of
returning None.

Common terms:

* ``tokens``: token ids (a sequence of ints, an int array or a 1-D tensor); only full
  blocks of ``layout.block_size`` tokens are ever stored or matched.
* ``scope``: :class:`~tierkv.identity.Scope` (model version, namespace, extra keys): the root
  of the key chain. Blocks of another scope are never seen.
* ``last_key``: the key of a chain's last block, as a manifest records it
  (``bytes.fromhex(manifest["last_block_key"])``).
* Errors are :class:`~tierkv.errors.TierKVError` subclasses (a daemon client re-raises the
  daemon's as the same class), plus ValueError for an argument out of range. Every method
  of a closed store raises NotFoundError (embedded) or DaemonUnavailableError (client);
  every method used from a forked child raises ForkedStoreError.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Protocol, Sequence, runtime_checkable

from .blocks import Priority

if TYPE_CHECKING:
    import numpy as np
    import torch

    from .identity import Scope
    from .layout import PageLayout
    from .results import (
        ChainTokens, InvalidateResult, Lease, LookupResult, PutResult, Residency, StoreStats, VerifyResult,
    )


def _missing(name: str) -> NotImplementedError:
    return NotImplementedError(f"this StoreAPI implementation lacks {name}")


@runtime_checkable
class StoreAPI(Protocol):
    """A tierkv store, wherever it runs. ``layout`` is the page layout of the pages it
    holds (every ``pages`` argument and every leased page has this shape and dtype). It is
    None only for a daemon client connected without a layout to a daemon serving several:
    such a client does operations (manifests, chains, invalidate, verify, stats) and raises
    for the data path."""

    layout: "PageLayout | None"

    # ---- read path -------------------------------------------------------------------------
    def lookup(self, tokens: "Sequence[int] | np.ndarray | torch.Tensor", scope: "Scope",
               block_extra: "Sequence[Sequence[str | bytes]] | None" = None) -> "LookupResult":
        """The longest stored prefix of ``tokens`` in ``scope``, token ids verified.

        Holds nothing and changes nothing a caller can see: a probe does not refresh LRU
        positions (only counters move). A block whose stored token ids differ from the
        request's ends the match and is quarantined. ``tiers`` names where each block was
        found ("device", "host", "disk"; a cluster node adds "remote" for blocks only the
        remote tier holds, which ``acquire`` will pull)."""
        raise _missing("lookup")

    def acquire(self, tokens: "Sequence[int] | np.ndarray | torch.Tensor", scope: "Scope",
                block_extra: "Sequence[Sequence[str | bytes]] | None" = None, max_blocks: int | None = None,
                start_block: int = 0, promote: bool = True) -> "Lease":
        """Lease blocks ``start_block ..`` (at most ``max_blocks``) of the longest stored
        prefix, promoted into the device tier. ``promote=False`` says the caller only copies
        the pages out and releases soon: a store may then serve a cold window from a buffer
        of the lease's own rather than the device tier (the embedded store does, once per
        block: tierkv/read_through.py; a daemon's clients read its device tier, so a daemon
        always promotes).

        The caller must end the lease (``with`` or ``release`` in ``finally``); until then
        its pages are never evicted, moved or overwritten. The lease may cover fewer blocks
        than ``lookup`` found (device tier full of other leases, a page that failed its
        checksum and was quarantined); zero blocks is a valid lease. Refreshes the chain's
        LRU position. Raises ValueError for ``start_block < 0``."""
        raise _missing("acquire")

    def release(self, lease: "Lease") -> None:
        """End ``lease`` (taken from this store); its blocks become evictable again and
        ephemeral ones are dropped. Raises LeaseError for a lease of another store or one
        already released."""
        raise _missing("release")

    def prefetch(self, tokens: "Sequence[int] | np.ndarray | torch.Tensor", scope: "Scope",
                 block_extra: "Sequence[Sequence[str | bytes]] | None" = None) -> "Future[int]":
        """Start promoting the stored prefix of ``tokens`` into the device tier in the
        background. The future gives the tokens now warm (or the error); nothing stays
        leased, so a later ``acquire`` may still find some of it evicted."""
        raise _missing("prefetch")

    def block_keys(self, tokens: "Sequence[int] | np.ndarray | torch.Tensor", scope: "Scope", n_blocks: int | None = None,
                   block_extra: "Sequence[Sequence[str | bytes]] | None" = None) -> list[bytes]:
        """The keys this store keeps the full blocks of ``tokens`` in ``scope`` under (the
        first ``n_blocks``; default all): what a manifest's ``last_block_key`` must be. A
        daemon under ``namespace_per_uid`` stores a peer's blocks in its own namespaces,
        so these are not always :func:`tierkv.identity.block_keys` of ``scope`` (this default:
        a store that keeps ``scope`` as given)."""
        from .identity import as_token_array, block_keys

        layout = getattr(self, "layout", None)
        if layout is None:
            raise _missing("block_keys")
        keys = block_keys(as_token_array(tokens), scope, layout.block_size, block_extra)
        return keys if n_blocks is None else keys[: max(0, n_blocks)]

    # ---- write path ------------------------------------------------------------------------
    def put(self, tokens: "Sequence[int] | np.ndarray | torch.Tensor", pages: "torch.Tensor", scope: "Scope", *,
            start_block: int = 0, block_extra: "Sequence[Sequence[str | bytes]] | None" = None,
            priority: Priority = Priority.NORMAL) -> "PutResult":
        """Store ``pages`` ``[n, L, 2, B, H, D]`` (this store's layout) as blocks
        ``start_block .. start_block + n - 1`` of ``tokens`` (which must reach that far).

        Blocks already stored are skipped. With
        write-through (the default) and for PINNED, the blocks are on disk, fsynced and
        indexed when this returns (``durable``); EPHEMERAL blocks stay in memory and go when
        their lease ends. Raises PageFormatError (shape, dtype, too few tokens),
        InvalidTokensError, DiskWriteError (the disk tier is then degraded)."""
        raise _missing("put")

    # ---- priority (pin / unpin) ------------------------------------------------------------
    def set_priority(self, tokens: "Sequence[int] | np.ndarray | torch.Tensor", scope: "Scope",
                     priority: Priority) -> int:
        """Set the priority of the stored prefix of ``tokens``; returns the blocks changed.
        PINNED blocks are written to disk first when they are not there, and are never
        evicted from it."""
        raise _missing("set_priority")

    def set_priority_from(self, last_key: bytes, priority: Priority) -> int:
        """:meth:`set_priority` for the stored chain ending at ``last_key`` (what ``tierkv
        pin NAME`` does with a manifest); returns the blocks changed (0 when the last
        block is not stored)."""
        raise _missing("set_priority_from")

    # ---- chains ----------------------------------------------------------------------------
    def chain_tokens(self, last_key: bytes) -> "ChainTokens":
        """Token ids, model version and namespace of the stored chain ending at
        ``last_key`` (for export and publishing). Raises NotFoundError when the last block is
        not stored. A missing middle block ends the walk early; the caller detects it by
        re-keying the tokens (the last key then differs)."""
        raise _missing("chain_tokens")

    def chain_residency(self, last_key: bytes) -> "Residency":
        """How many blocks of the chain ending at ``last_key`` are stored, and how many of
        them each tier holds. All zero when the last block is not stored; never raises for
        an unknown key."""
        raise _missing("chain_residency")

    # ---- named prefixes (manifests) --------------------------------------------------------
    def save_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        """Record (or replace) the JSON-able ``manifest`` under ``name``, durably. Write the
        blocks first: a manifest must never name blocks that were not stored. Raises
        ValueError for a name that is empty, over 200 characters or contains '/'."""
        raise _missing("save_manifest")

    def get_manifest(self, name: str) -> dict[str, Any]:
        """The manifest named ``name`` (a copy the caller may change). Raises NotFoundError
        (naming the known prefixes) when there is none."""
        raise _missing("get_manifest")

    def list_manifests(self) -> dict[str, dict[str, Any]]:
        """Every named prefix: name -> manifest."""
        raise _missing("list_manifests")

    def delete_manifest(self, name: str) -> bool:
        """Forget the name (the blocks stay); returns whether it existed."""
        raise _missing("delete_manifest")

    # ---- operations ------------------------------------------------------------------------
    def invalidate(self, *, model_version: str | None = None, namespace: str | None = None,
                   dry_run: bool = False) -> "InvalidateResult":
        """Remove every block of ``model_version`` and/or ``namespace`` from every tier
        (index first, then pages; leased blocks become unreachable now and are freed at
        release). Idempotent. ``dry_run`` changes nothing and reports what would go. Raises
        ValueError when neither is given."""
        raise _missing("invalidate")

    def verify(self, repair: bool = False) -> "VerifyResult":
        """Re-read and checksum every disk page; with ``repair`` quarantine the bad ones
        (they are then misses). Lookups and acquires go on meanwhile."""
        raise _missing("verify")

    def stats(self, namespace_limit: int | None = None, namespace_after: str | None = None) -> "StoreStats":
        """Occupancy per tier, blocks per model version and namespace, traffic counters
        (of the process that holds the store: the daemon's for a client).

        ``namespaces`` is a page: sorted by name, those after ``namespace_after`` (all when
        None), at most ``namespace_limit`` of them (ValueError unless a positive int or
        None). ``namespaces_next`` is the cursor of the next page (pass it as
        ``namespace_after``), None on the last. Every other figure (blocks, tiers,
        counters) covers the whole store on every page. An embedded store returns all
        namespaces by default; a daemon client at most ``DEFAULT_STATS_NAMESPACES`` (1,000),
        so a reply stays bounded: :func:`tierkv.results.stats_all_namespaces` joins the
        pages."""
        raise _missing("stats")

    def check_integrity(self) -> None:
        """Recompute every total this object keeps from its source of truth; raises
        AssertionError on a mismatch. A daemon client checks its own state (connection,
        leases), then has the daemon check its stores; a cluster node checks its store and
        the remote tier's state."""
        raise _missing("check_integrity")

    # ---- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Release everything this object holds (a client: the daemon releases the leases
        this connection still holds). Idempotent; every other method raises afterwards."""
        raise _missing("close")

    def __enter__(self) -> "StoreAPI":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["StoreAPI"]
