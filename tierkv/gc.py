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
* Every named prefix kept is reported (:class:`Kept`: its stored name, scope and blocks).

A manifest's scope is where its blocks *are*: the stored chain's own (model version,
namespace) when its last block is stored, else the manifest's recorded fields. Issue #34,
item 5: under ``namespace_per_uid`` a tenant's manifest recorded the namespace as the tenant
sent it (``default``) while its blocks lived under ``uid65534/default``, and ``gc --home``
removed the tenant's pinned prefix and deleted its manifest. The chain cannot disagree with
the blocks (it is their record); the recorded namespace is the fallback for a chain whose
last block is gone (or whose last key names no stored block), and the daemon now records
the effective one (``Tenancy.stored_manifest``).

Everything goes through the public store API, so gc works on a home (``Home``) and in
the daemon, which runs it over its own stores for ``gc --socket`` (GC), so that it sees every
tenant's manifests and namespaces (a tenant's view hides the others': gc through it found no
model version and removed nothing, silently).
Rejected: keeping a block when *any* manifest shares its model version regardless of
namespace: one prefix would then keep every tenant's cache of that model alive forever.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

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
class Kept:
    """A named prefix gc kept: its stored name (``uid<N>:<name>`` for a tenant's under
    ``namespace_per_uid``), the scope its blocks live in, and how many of them are stored."""

    name: str
    model_version: str
    namespace: str
    blocks: int


@dataclass(frozen=True)
class GcResult:
    removed: tuple[Removal, ...]
    deleted_manifests: tuple[str, ...]
    kept_scopes: tuple[tuple[str, str], ...]  # (model version, namespace) named by manifests
    dry_run: bool
    kept: tuple[Kept, ...] = ()  # every named prefix kept

    @property
    def removed_blocks(self) -> int:
        return sum(r.blocks for r in self.removed)

    @property
    def freed_bytes(self) -> int:
        return sum(r.freed_bytes for r in self.removed)

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape (``tierkv gc --json``, the daemon's GC reply)."""
        return {"dry_run": self.dry_run, "removed_blocks": self.removed_blocks, "freed_bytes": self.freed_bytes,
                "removed": [{"model_version": x.model_version, "namespace": x.namespace, "blocks": x.blocks,
                             "freed_bytes": x.freed_bytes} for x in self.removed],
                "deleted_manifests": list(self.deleted_manifests), "kept_scopes": [list(s) for s in self.kept_scopes],
                "kept_prefixes": [{"name": k.name, "model_version": k.model_version, "namespace": k.namespace,
                                   "blocks": k.blocks} for k in self.kept]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GcResult":
        return cls(tuple(Removal(str(x["model_version"]), None if x["namespace"] is None else str(x["namespace"]),
                                 int(x["blocks"]), int(x["freed_bytes"])) for x in d["removed"]),
                   tuple(str(n) for n in d["deleted_manifests"]),
                   tuple((str(mv), str(ns)) for mv, ns in d["kept_scopes"]), bool(d["dry_run"]),
                   tuple(Kept(str(k["name"]), str(k["model_version"]), str(k["namespace"]), int(k["blocks"]))
                         for k in d["kept_prefixes"]))


def _last_key(manifest: dict) -> bytes | None:
    try:
        return bytes.fromhex(manifest["last_block_key"]) if manifest.get("last_block_key") else None
    except (TypeError, ValueError):
        return None


def manifest_scope(store: "StoreAPI", manifest: dict) -> tuple[str, str] | None:
    """(model version, namespace) where a manifest's blocks live: the stored chain's (its
    blocks' own record, which cannot disagree with them), else the manifest's recorded
    fields, the namespace defaulting to the one materialise uses ("default"). None when
    neither names a model version."""
    last = _last_key(manifest)
    if last is not None:
        try:
            _, mv, ns = store.chain_tokens(last)
            return mv, ns
        except NotFoundError:
            pass
    mv = manifest.get("model_version")
    if not mv:
        return None
    return str(mv), str(manifest.get("namespace") or "default")


def collect(store: "StoreAPI", keep_model_versions: Iterable[str] = (), keep_namespaces: Iterable[str] = (),
            dry_run: bool = False) -> GcResult:
    """Remove blocks that are not in use (see the module docstring) from ``store`` (a Store,
    Home, or the daemon's view of its stores) and delete manifests whose blocks are
    all gone. Through a daemon client it sees only that connection's tenant: the CLI asks
    the daemon to run it instead (``Client.gc``). ``dry_run`` changes
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
    kept: list[Kept] = []
    for name, m in sorted(manifests.items()):
        scope = scopes[name]
        last = _last_key(m)
        if scope is None or last is None:
            continue
        stored = store.chain_residency(last).blocks
        # In-use scopes are never touched above, so a dry run sees the same counts.
        if not stored and not store.invalidate(model_version=scope[0], namespace=scope[1], dry_run=True).removed_blocks:
            if not dry_run:
                store.delete_manifest(name)
            deleted.append(name)
        else:
            kept.append(Kept(name, scope[0], scope[1], stored))
    return GcResult(tuple(removed), tuple(deleted), tuple(sorted(named)), dry_run, tuple(kept))
