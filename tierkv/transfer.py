"""Export and import of a named prefix, on top of the bundle format (:mod:`tierkv.bundle`).

Export reads the prefix's pages a window at a time through leases (so any store, embedded or
a daemon client, and any device-tier size will do) and streams them into a bundle. Import
checks the whole bundle first (:func:`tierkv.bundle.verify_bundle`), then puts the pages in
chunks and records the manifest last, so a failed import leaves no manifest pointing at
missing blocks.
"""
from __future__ import annotations

import datetime
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from .blocks import Priority
from .bundle import BundleError, BundleHeader, BundleReader, verify_bundle, write_bundle
from .errors import CapacityError, LayoutMismatchError, ModelVersionMismatchError, NotFoundError
from .identity import Scope, block_keys
from .layout import PageLayout


@dataclass(frozen=True)
class ExportResult:
    name: str
    path: Path
    tokens: int
    blocks: int
    model_version: str
    namespace: str
    file_bytes: int


@dataclass(frozen=True)
class ImportResult:
    name: str
    tokens: int
    blocks: int
    stored: int  # blocks written by this import
    skipped: int  # blocks the store already held
    durable: bool
    model_version: str
    namespace: str
    replaced_manifest: bool = False
    warnings: tuple[str, ...] = field(default=())


def export_prefix(store: Any, name: str, path: Path) -> ExportResult:
    """Write the prefix named ``name`` (a manifest) from ``store`` (a Store or a Client) to
    ``path``. Raises NotFoundError when the manifest is unknown or its chain is not fully
    stored, CapacityError when the device tier cannot lease the whole prefix."""
    manifest = store.get_manifest(name)
    last_hex = manifest.get("last_block_key")
    if not last_hex:
        raise NotFoundError(f"prefix {name!r} has no full block to export")
    last = bytes.fromhex(last_hex)
    tokens, mv, ns = store.chain_tokens(last)
    layout: PageLayout = store.layout
    scope = Scope(mv, ns, tuple(manifest.get("extra_keys", ())))
    keys = block_keys(tokens, scope, layout.block_size)
    if not keys or keys[-1] != last:
        raise NotFoundError(
            f"prefix {name!r} is not fully stored (a block before its last one is gone)",
            hint=f"run `tierkv materialize ... --name {name}` again, then export",
        )
    n = len(keys)
    header = BundleHeader(
        layout=layout, model_version=mv, namespace=ns, tokens=len(tokens), blocks=n, last_block_key=last_hex,
        tokens_sha256=hashlib.sha256(tokens.tobytes()).hexdigest(), name=name, manifest=manifest,
        extra_keys=scope.extra_keys,
        created_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    )
    size = write_bundle(path, header, tokens, _leased_pages(store, tokens, scope, n, name))
    return ExportResult(name, Path(path), len(tokens), n, mv, ns, size)


def _leased_pages(store: Any, tokens: np.ndarray, scope: Scope, n: int, name: str,
                  window: int = 64) -> Iterator[torch.Tensor]:
    """Pages 0..n-1 of the prefix, leased ``window`` blocks at a time (so a prefix larger
    than the device tier exports with a small one); each page is yielded while leased."""
    start = 0
    while start < n:
        with store.acquire(tokens, scope, max_blocks=min(window, n - start), start_block=start) as lease:
            if lease.num_blocks == 0:
                raise CapacityError(
                    f"could not lease block {start} of the {n} blocks of {name!r} into the device tier",
                    hint="release other leases, or raise the device tier",
                )
            for i in range(lease.num_blocks):
                yield lease.page(i)
            start += lease.num_blocks


def check_compatible(header: BundleHeader, layout: PageLayout, model_version: str | None, force: bool) -> None:
    """Raise LayoutMismatchError when the bundle's pages do not fit ``layout`` (no override:
    the bytes would be misread), ModelVersionMismatchError when ``model_version`` is given,
    differs from the bundle's and ``force`` is not set."""
    if header.layout != layout:
        raise LayoutMismatchError(
            f"the bundle holds pages of layout {header.layout.to_json()}, the store holds {layout.to_json()}",
            hint="import into a home of the same model and block size (or a fresh --home)",
        )
    if model_version is not None and model_version != header.model_version and not force:
        raise ModelVersionMismatchError(
            f"the bundle was made under model version {header.model_version[:16]}…, "
            f"the given model is {model_version[:16]}…",
            hint="pass the model the bundle was made with, or --force to import it anyway",
        )


def import_bundle(store: Any, path: Path, *, name: str | None = None, force: bool = False,
                  model_version: str | None = None, verified: BundleHeader | None = None) -> ImportResult:
    """Store the pages of the bundle at ``path`` and write its manifest as ``name``
    (default: the exported name), after the pages are stored.

    Refuses (before storing anything) a damaged bundle (BundleError), one of another page
    layout than the store's (LayoutMismatchError), one made under another model version
    than ``model_version`` when that is given (ModelVersionMismatchError), and a name that
    already names another prefix; ``force`` overrides the last two. ``verified`` is the
    header :func:`verify_bundle` returned for ``path`` when the caller already checked the
    whole file (the first pass is then skipped).
    """
    header = verified if verified is not None else verify_bundle(path)
    layout: PageLayout = store.layout
    check_compatible(header, layout, model_version, force)
    name = name or header.name
    replaced = False
    try:
        existing = store.get_manifest(name)
    except NotFoundError:
        existing = None
    if existing is not None:
        if existing.get("last_block_key") != header.last_block_key and not force:
            raise BundleError(f"a different prefix is already named {name!r}",
                              hint="pass --name NEW, or --force to replace it")
        replaced = True
    pinned = bool(header.manifest.get("pinned"))
    priority = Priority.PINNED if pinned else Priority.NORMAL
    bs = layout.block_size
    stored = skipped = 0
    with BundleReader(path) as r:
        if r.header != header:
            raise BundleError(f"{path} changed while it was imported")
        r.check_tokens()
        for start, pages in r.iter_pages():
            end = start + int(pages.shape[0])
            res = store.put(r.tokens[: end * bs], pages, header.scope, start_block=start, priority=priority)
            stored += res.stored
            skipped += res.skipped
    warnings: list[str] = []
    resident = store.chain_residency(bytes.fromhex(header.last_block_key))
    durable = resident.blocks == header.blocks and resident.disk == header.blocks
    if not durable:
        warnings.append(f"only {resident.disk} of {header.blocks} blocks are on the disk tier")
    # The manifest goes last: it must never name blocks that were not stored.
    manifest = dict(header.manifest)
    manifest.update(
        last_block_key=header.last_block_key, model_version=header.model_version, namespace=header.namespace,
        pinned=pinned,
        imported={"from": str(Path(path).resolve()), "name": header.name, "created_at": header.created_at},
    )
    store.save_manifest(name, manifest)
    return ImportResult(name, header.tokens, header.blocks, stored, skipped, durable, header.model_version,
                        header.namespace, replaced, tuple(warnings))
