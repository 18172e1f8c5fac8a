"""Garbage collection: give back the space of blocks nothing refers to any more.

The rule (``tierkv gc``, docs/cli.md):

* A block is *in use* when its model version is kept (``keep_model_versions``: the CLI's
  ``--keep-model DIR`` / ``--keep-model-version HEX``), when its namespace is kept
  (``keep_namespaces``), or when its (model version, namespace) is the scope of a named
  prefix (a manifest).
* Every other block is removed, one ``invalidate(model_version=, namespace=)`` per scope:
  index first, then the pages, and segment files left empty are deleted.
* A manifest is deleted when none of its blocks can be left: its last block is not stored
  and its scope holds no block at all. A manifest whose last block was evicted while
  earlier blocks remain is kept (materialising it again completes it).

Everything goes through the public store API, so gc works on a home and through a daemon.
Rejected: keeping a block when *any* manifest shares its model version regardless of
namespace: one prefix would then keep every tenant's cache of that model alive forever.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable

from .errors import NotFoundError
from .results import stats_all_namespaces

if TYPE_CHECKING:
    from .api import StoreAPI


@dataclass(frozen=True)
class Removal:
    model_version: str
    namespace: str | None  # None: every namespace of the model version
    blocks: int
    freed_bytes: int


@dataclass(frozen=True)
class GcResult:
    removed: tuple[Removal, ...]
    deleted_manifests: tuple[str, ...]
    kept_scopes: tuple[tuple[str, str], ...]  # (model version, namespace) named by manifests
    dry_run: bool

    @property
    def removed_blocks(self) -> int:
        return sum(r.blocks for r in self.removed)

    @property
    def freed_bytes(self) -> int:
        return sum(r.freed_bytes for r in self.removed)


def manifest_scope(store: "StoreAPI", manifest: dict) -> tuple[str, str] | None:
    """(model version, namespace) of a manifest: its recorded fields, else the stored chain's,
    else the namespace materialise uses ("default"). None for a manifest with no model version."""
    mv = manifest.get("model_version")
    if not mv:
        return None
    ns = manifest.get("namespace")
    if ns is None and manifest.get("last_block_key"):
        try:
            _, _, ns = store.chain_tokens(bytes.fromhex(manifest["last_block_key"]))
        except NotFoundError:
            ns = None
    return str(mv), str(ns or "default")


def collect(store: "StoreAPI", keep_model_versions: Iterable[str] = (), keep_namespaces: Iterable[str] = (),
            dry_run: bool = False) -> GcResult:
    """Remove blocks that are not in use (see the module docstring) from ``store`` (a Store
    or a Client) and delete manifests whose blocks are all gone. ``dry_run`` changes
    nothing and reports what would go."""
    keep_mv = set(keep_model_versions)
    keep_ns = set(keep_namespaces)
    manifests = store.list_manifests()
    scopes = {name: manifest_scope(store, m) for name, m in manifests.items()}
    named = {s for s in scopes.values() if s is not None}
    stats = stats_all_namespaces(store)  # every namespace, not a daemon's first page
    model_versions = sorted(stats["model_versions"])
    namespaces = sorted(stats["namespaces"])

    removed: list[Removal] = []
    for mv in model_versions:
        if mv in keep_mv:
            continue
        if not keep_ns and not any(m == mv for m, _ in named):
            # Nothing keeps any block of this model version: one call removes them all.
            r = store.invalidate(model_version=mv, dry_run=dry_run)
            if r.removed_blocks:
                removed.append(Removal(mv, None, r.removed_blocks, r.freed_bytes))
            continue
        for ns in namespaces:
            if ns in keep_ns or (mv, ns) in named:
                continue
            r = store.invalidate(model_version=mv, namespace=ns, dry_run=dry_run)
            if r.removed_blocks:
                removed.append(Removal(mv, ns, r.removed_blocks, r.freed_bytes))

    deleted: list[str] = []
    for name, m in sorted(manifests.items()):
        scope = scopes[name]
        last = m.get("last_block_key")
        if scope is None or not last:
            continue
        if store.chain_residency(bytes.fromhex(last)).blocks:
            continue
        # In-use scopes are never touched above, so a dry run sees the same counts.
        if store.invalidate(model_version=scope[0], namespace=scope[1], dry_run=True).removed_blocks:
            continue
        if not dry_run:
            store.delete_manifest(name)
        deleted.append(name)
    return GcResult(tuple(removed), tuple(deleted), tuple(sorted(named)), dry_run)
