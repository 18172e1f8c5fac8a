"""A home as one uid sees it (issue #32): :class:`TenantView`, a :class:`~tierkv.api.StoreAPI`
that applies :class:`~tierkv.home.tenancy.Tenancy`'s rules to every call on a
:class:`~tierkv.home.home.Home`: the tenant's namespaces and manifest names get its prefix on
the way in and lose it on the way out, a chain or name of another tenant is not there, and
the operations over every tenant's blocks (verify, integrity) are the daemon's uid's.

Without ``namespace_per_uid`` the tenancy rewrites nothing and the view is the home itself.
It owns nothing: closing it ends the view and closes no store.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Sequence

from ..api import StoreAPI
from ..errors import NotFoundError
from ..identity import Scope
from ..priority import Priority
from ..results import ChainTokens, InvalidateResult, Residency, StoreStats, VerifyResult, namespace_page
from .tenancy import Tenancy

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ..results import Lease, LookupResult, PutResult
    from .home import Home

class TenantView(StoreAPI):
    """``home`` as ``uid`` sees it under ``tenancy``."""

    def __init__(self, home: "Home", tenancy: Tenancy, uid: int) -> None:
        self.home = home
        self.tenancy = tenancy
        self.uid = uid
        self.layout = home.layout
        self._closed = False

    def _live(self) -> "Home":
        if self._closed:
            raise NotFoundError("this tenant view is closed", hint="make a new TenantView of the home")
        return self.home

    def _scope(self, scope: Scope) -> Scope:
        ns = self.tenancy.namespace(self.uid, scope.namespace)
        return scope if ns == scope.namespace else Scope(scope.model_version, ns, scope.extra_keys)

    # ---- the data path: the tenant's namespaces ----------------------------------------------
    def lookup(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
               block_extra: Sequence[Sequence[str | bytes]] | None = None) -> "LookupResult":
        return self._live().lookup(tokens, self._scope(scope), block_extra)

    def acquire(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                block_extra: Sequence[Sequence[str | bytes]] | None = None, max_blocks: int | None = None,
                start_block: int = 0, promote: bool = True) -> "Lease":
        return self._live().acquire(tokens, self._scope(scope), block_extra, max_blocks, start_block, promote)

    def release(self, lease: "Lease") -> None:
        self._live().release(lease)

    def prefetch(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope,
                 block_extra: Sequence[Sequence[str | bytes]] | None = None) -> "Future[int]":
        return self._live().prefetch(tokens, self._scope(scope), block_extra)

    def block_keys(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, n_blocks: int | None = None,
                   block_extra: Sequence[Sequence[str | bytes]] | None = None) -> list[bytes]:
        return self._live().block_keys(tokens, self._scope(scope), n_blocks, block_extra)

    def put(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, pages: torch.Tensor, scope: Scope, *,
            start_block: int = 0, block_extra: Sequence[Sequence[str | bytes]] | None = None,
            priority: Priority = Priority.NORMAL) -> "PutResult":
        return self._live().put(tokens, pages, self._scope(scope), start_block=start_block, block_extra=block_extra,
                             priority=priority)

    def set_priority(self, tokens: Sequence[int] | np.ndarray | torch.Tensor, scope: Scope, priority: Priority) -> int:
        return self._live().set_priority(tokens, self._scope(scope), priority)

    # ---- chains: only the tenant's own ---------------------------------------------------------
    def chain_tokens(self, last_key: bytes) -> ChainTokens:
        """The chain ending at ``last_key`` with its namespace as the tenant names it;
        NotFoundError for a chain of another tenant's namespace (a key must not let one
        tenant read or pin another's)."""
        tokens, mv, ns = self._live().chain_tokens(last_key)
        own = self.tenancy.namespace_prefix(self.uid)
        if not ns.startswith(own):
            raise NotFoundError(f"block {last_key.hex()[:16]} is not stored")
        return ChainTokens(tokens, mv, ns[len(own):])

    def chain_residency(self, last_key: bytes) -> Residency:
        try:
            self.chain_tokens(last_key)
        except NotFoundError:
            return Residency()
        return self._live().chain_residency(last_key)

    def set_priority_from(self, last_key: bytes, priority: Priority) -> int:
        try:
            self.chain_tokens(last_key)
        except NotFoundError:
            return 0
        return self._live().set_priority_from(last_key, priority)

    # ---- manifests: the tenant's names -----------------------------------------------------------
    def save_manifest(self, name: str, manifest: dict[str, Any]) -> None:
        self._live().save_manifest(self.tenancy.manifest_name(self.uid, name),
                                self.tenancy.stored_manifest(self.uid, manifest))

    def list_manifests(self) -> dict[str, dict[str, Any]]:
        mine = self.tenancy.visible_manifests(self.uid, self._live().list_manifests())
        return {k: self.tenancy.visible_manifest(self.uid, v) for k, v in mine.items()}

    def get_manifest(self, name: str) -> dict[str, Any]:
        every = self._live().list_manifests()
        hit = every.get(self.tenancy.manifest_name(self.uid, name))
        if hit is None:  # a tenant learns only its own names
            mine = self.tenancy.visible_manifests(self.uid, every)
            raise NotFoundError(f"no prefix named {name!r} (known: {', '.join(sorted(mine)) or 'none'})")
        return self.tenancy.visible_manifest(self.uid, hit)

    def delete_manifest(self, name: str) -> bool:
        return self._live().delete_manifest(self.tenancy.manifest_name(self.uid, name))

    # ---- across the home ---------------------------------------------------------------------------
    def invalidate(self, *, model_version: str | None = None, namespace: str | None = None,
                   dry_run: bool = False) -> InvalidateResult:
        """The tenant's blocks only: ``namespace`` is one of its own; without one, every
        namespace it has (for ``model_version``)."""
        if model_version is None and namespace is None:
            raise ValueError("invalidate needs model_version or namespace")
        if namespace is not None or not self.tenancy.per_uid:
            targets: list[str | None] = [None if namespace is None else self.tenancy.namespace(self.uid, namespace)]
        else:
            stored = self._live().merged_stats()["namespaces"]
            targets = list(self.tenancy.own_namespaces(self.uid, stored))
        rs = [self._live().invalidate(model_version=model_version, namespace=ns, dry_run=dry_run) for ns in targets]
        return InvalidateResult(sum(r.removed_blocks for r in rs), sum(r.freed_bytes for r in rs), dry_run)

    def verify(self, repair: bool = False) -> VerifyResult:
        self.tenancy.check_whole_store(self.uid, "verify")
        return self._live().verify(repair)

    def stats(self, namespace_limit: int | None = None, namespace_after: str | None = None) -> StoreStats:
        """The home's stats with only the tenant's namespaces (and no per-model-version
        counts), paged; each layout's figures carry the namespaces of the page only."""
        namespace_page({}, namespace_limit, namespace_after)  # ValueError on a bad limit, as the Store's
        merged = self._live().merged_stats()
        out = self.tenancy.visible_stats(self.uid, merged)
        out["namespaces"], after = namespace_page(out["namespaces"], namespace_limit, namespace_after)
        if after is not None:
            out["namespaces_next"] = after
        layouts = {}
        for lid, ls in merged["layouts"].items():
            ls = self.tenancy.visible_stats(self.uid, ls)
            page = {ns: n for ns, n in ls["namespaces"].items() if ns in out["namespaces"]}
            layouts[lid] = {**ls, "namespaces": page}
        out["layouts"] = layouts
        return StoreStats.from_dict(out)

    def check_integrity(self) -> None:
        self.tenancy.check_whole_store(self.uid, "check_integrity")
        self._live().check_integrity()

    def close(self) -> None:
        """Ends the view (every method but ``close`` then raises); the home and its stores
        stay open: the view owns none of them."""
        self._closed = True

    def __enter__(self) -> "TenantView":
        return self
