"""Tenants under ``namespace_per_uid``: what one peer uid may see and touch.

With ``namespace_per_uid`` every peer uid is a tenant, derived on the daemon side from the
kernel's ``SO_PEERCRED`` (never from anything the client sends). A tenant's namespaces are
stored as ``uid<N>/<name>`` and its manifests as ``uid<N>:<name>``; the daemon adds the
prefix on the way in and removes it on the way out, so a client names only its own and
sees only its own:

* block requests (lookup, acquire, put, prefetch, priority) key under its namespaces, so it
  can neither hit nor probe another tenant's blocks;
* manifests: save, get, list and delete see only its names; a manifest's namespace is stored
  as the effective one (where its blocks are) and shown without the prefix;
* ``stats`` lists only its namespaces (and no per-model-version counts, which would show
  which models other tenants serve); tier occupancy stays global;
* ``invalidate`` without a namespace removes only its blocks;
* ``verify`` (a full read of every disk page, with repair a quarantine across tenants)
  and ``gc`` (which removes blocks of every tenant no named prefix keeps) are the daemon's
  own uid's.

Without ``namespace_per_uid`` the admitted peers share one store and nothing is rewritten.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ..errors import NotPermittedError
from ..manifest_names import MAX_NAME, check_name


@dataclass(frozen=True)
class Tenancy:
    per_uid: bool
    daemon_uid: int = field(default_factory=os.getuid)

    # ---- namespaces -----------------------------------------------------------------------
    def namespace_prefix(self, uid: int) -> str:
        return f"uid{uid}/" if self.per_uid else ""

    def namespace(self, uid: int, namespace: str) -> str:
        """The namespace the store sees for what the client calls ``namespace``."""
        return self.namespace_prefix(uid) + namespace

    def own_namespaces(self, uid: int, all_namespaces: Any) -> list[str]:
        """The stored namespaces (effective names) that belong to ``uid``."""
        prefix = self.namespace_prefix(uid)
        return sorted(ns for ns in all_namespaces if ns.startswith(prefix))

    # ---- manifests ------------------------------------------------------------------------
    def manifest_prefix(self, uid: int) -> str:
        return f"uid{uid}:" if self.per_uid else ""

    def manifest_name(self, uid: int, name: str) -> str:
        """The stored name of the client's manifest ``name``; ValueError for a name the
        store could not hold (empty, too long, '/', or not encodable as UTF-8: a lone
        surrogate reached LMDB as a raw UnicodeEncodeError)."""
        check_name(name, MAX_NAME - len(self.manifest_prefix(uid)))
        return self.manifest_prefix(uid) + name

    def visible_manifests(self, uid: int, manifests: dict[str, dict]) -> dict[str, dict]:
        prefix = self.manifest_prefix(uid)
        return {k[len(prefix):]: v for k, v in manifests.items() if k.startswith(prefix)}

    def stored_manifest(self, uid: int, manifest: dict) -> dict:
        """A manifest as the daemon stores it: its namespace the effective one, where the
        tenant's blocks live (issue #34, item 5: kept as sent, ``gc --home`` looked for the
        blocks under ``default`` and removed the tenant's pinned prefix). The inverse of
        :meth:`visible_manifest`."""
        ns = manifest.get("namespace")
        if self.per_uid and isinstance(ns, str):
            return {**manifest, "namespace": self.namespace(uid, ns)}
        return manifest

    def visible_manifest(self, uid: int, manifest: dict) -> dict:
        """A manifest as its owner sees it: its namespace without the tenant prefix."""
        prefix = self.namespace_prefix(uid)
        ns = manifest.get("namespace")
        if prefix and isinstance(ns, str) and ns.startswith(prefix):
            return {**manifest, "namespace": ns[len(prefix):]}
        return manifest

    # ---- stats and whole-store operations ---------------------------------------------------
    def visible_stats(self, uid: int, stats: dict[str, Any]) -> dict[str, Any]:
        if not self.per_uid:
            return stats
        prefix = self.namespace_prefix(uid)
        out = dict(stats)
        out["namespaces"] = {ns[len(prefix):]: n for ns, n in stats.get("namespaces", {}).items()
                             if ns.startswith(prefix)}
        out.pop("model_versions", None)
        return out

    def check_whole_store(self, uid: int, what: str) -> None:
        """Refuse an operation over every tenant's blocks to a tenant (NotPermittedError)."""
        if self.per_uid and uid != self.daemon_uid:
            raise NotPermittedError(f"{what} reads every tenant's blocks; under namespace_per_uid only the "
                                    f"daemon's uid ({self.daemon_uid}) may run it, not uid {uid}")
