"""Refreshing a named prefix after its files changed, recomputing only what changed (issue #35).

Attention is causal: every token's KV depends on every token before it, so an edit at
position p invalidates every block after p, however small the edit. A refresh keeps p late:

* ``append`` (the default): the previous document stays exactly as it was, token for token,
  and each changed file follows it as a new section (``=== path (updated) ===``; a new file
  ``(added)``, a deleted one ``(removed)`` with no text). The model reads a file's newer
  version after its older one, as an agent's context grows; the refresh computes the changed
  files only. Token ids of the kept part come from the stored chain (the older versions of
  the changed files are no longer on disk), plus the few ids after its last full block,
  which the manifest keeps (``tail_tokens``).
* ``reorder``, and a *compaction* of an appended document: one current copy of each file,
  unchanged files in the order the manifest recorded, changed and added ones last (in the
  document's own order, ``--order history``: least recently changed first). It computes from
  the first changed file's old place to the end.

An append compacts instead when the text it leaves behind (older versions and removed
files) would exceed ``max_stale`` of the document's bytes, when the document would outgrow
the model's context, when it was cut with ``--max-tokens``, or when the stored chain it
extends is gone (evicted). Either way the result is one token sequence whose cached blocks
are those a full prefill of it would store, so its logits equal a recomputation's.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .document import Document, DocumentOptions, build_document
from .errors import ConfigError, NotFoundError
from .materialize import PrefixTokens, check_length, check_prefix_model, materialize
from .prefix_record import Changes, arrange, current_files, diff, source_entries, stored_tokens
from .priority import Priority

if TYPE_CHECKING:
    from .api import StoreAPI
    from .hf.model import LoadedModel

REFRESH_MODES = ("append", "reorder")
DEFAULT_MAX_STALE = 0.25  # of the document's bytes: past it, an append compacts


@dataclass(frozen=True)
class Arranged:
    """A document to prefill: its token ids and the manifest fields that say how they were
    made (``order``, ``sources``, ``appended``, ``stale_bytes``, ``document_sha256``), so that
    :func:`tierkv.materialize.load_prefix` can give the same ids back."""

    document: Document
    tokens: list[int]
    record: dict[str, Any]
    mode: str  # "new", "unchanged", "append", "reorder" or "compact"
    changes: Changes = field(default_factory=Changes)


def _record(document: Document, options: DocumentOptions, **extra: Any) -> dict[str, Any]:
    return {"order": options.order, "sources": source_entries(document), "appended": [], "stale_bytes": 0,
            "document_sha256": document.sha256, **extra}


def refresh(store: "StoreAPI", lm: "LoadedModel", manifest: dict[str, Any], document: Document,
            options: DocumentOptions, *, mode: str = "append", max_stale: float = DEFAULT_MAX_STALE,
            max_tokens: int | None = None) -> Arranged:
    """The refreshed document of the prefix ``manifest`` names, now that its files are
    ``document`` (built with the manifest's own options). See the module docstring."""
    if mode not in REFRESH_MODES:
        raise ConfigError(f"unknown refresh mode {mode!r}", hint=f"use one of {', '.join(REFRESH_MODES)}")
    if not 0.0 <= max_stale <= 1.0:
        raise ConfigError(f"max_stale must lie in [0, 1], got {max_stale}", hint="e.g. 0.25: a quarter of the bytes")
    changes = diff(manifest, document)
    if not changes.any:
        return _unchanged(store, lm, manifest, document, options)
    if mode == "append" and max_tokens is None:
        appended = _append(store, lm, manifest, document, changes, max_stale)
        if appended is not None:
            return appended
        mode = "compact"
    order = [p for p in current_files(manifest) if p not in changes.changed]
    kept = arrange(document, order)  # changed and added files follow, in the document's order
    return Arranged(kept, lm.encode_document(kept.text), _record(kept, options), mode, changes)


def _unchanged(store: "StoreAPI", lm: "LoadedModel", manifest: dict[str, Any], document: Document,
               options: DocumentOptions) -> Arranged:
    if manifest.get("appended"):  # the older versions it holds are not on disk: the stored ids
        try:
            tokens = stored_tokens(store, manifest)
        except NotFoundError:
            return _compacted(lm, manifest, document, options)
        record = {k: manifest[k] for k in ("order", "sources", "appended", "stale_bytes", "document_sha256")
                  if k in manifest}
        return Arranged(document, tokens, record, "unchanged")
    kept = arrange(document, [s["path"] for s in manifest.get("sources", [])])
    return Arranged(kept, lm.encode_document(kept.text), _record(kept, options), "unchanged")


def _compacted(lm: "LoadedModel", manifest: dict[str, Any], document: Document, options: DocumentOptions) -> Arranged:
    kept = arrange(document, list(current_files(manifest)))
    return Arranged(kept, lm.encode_document(kept.text), _record(kept, options), "compact")


def _append(store: "StoreAPI", lm: "LoadedModel", manifest: dict[str, Any], document: Document,
            changes: Changes, max_stale: float) -> Arranged | None:
    """The appended document, or None when it should compact instead."""
    try:
        before = stored_tokens(store, manifest)
    except NotFoundError:
        return None  # the chain it would extend is gone: nothing left to keep
    held = current_files(manifest)
    text_of = {f.path: (f, s) for f, s in zip(document.files, document.sections)}
    parts: list[str] = []
    entries: list[dict[str, Any]] = []
    for change, paths in (("updated", changes.changed), ("added", changes.added), ("removed", changes.removed)):
        for path in paths:
            if change == "removed":
                parts.append(f"=== {path} (removed) ===\n")
                entries.append({"path": path, "sha256": "", "bytes": 0, "change": "removed"})
                continue
            f, section = text_of[path]
            parts.append(f"=== {path} ({change}) ===\n" + section.split("\n", 1)[1])
            entries.append({"path": path, "sha256": f.sha256, "bytes": f.size, "change": change})
    text = "".join(parts)
    stale = int(manifest.get("stale_bytes", 0)) + sum(int(held[p]["bytes"]) for p in changes.changed + changes.removed)
    total = sum(int(s["bytes"]) for s in manifest.get("sources", [])) + sum(
        int(e["bytes"]) for e in manifest.get("appended", [])) + sum(e["bytes"] for e in entries)
    tokens = before + lm.encode_prompt(text)
    limit = lm.context_length
    if (total and stale / total > max_stale) or (limit is not None and len(tokens) > limit):
        return None
    previous_sha = str(manifest.get("document_sha256", ""))
    record = {"order": manifest.get("order", "path"), "sources": manifest.get("sources", []),
              "appended": list(manifest.get("appended", [])) + entries, "stale_bytes": stale,
              # The text of the older part is not at hand: the document's digest is chained.
              "document_sha256": hashlib.sha256((previous_sha + text).encode("utf-8")).hexdigest()}
    return Arranged(document, tokens, record, "append", changes)


@dataclass(frozen=True)
class RefreshResult:
    """A refresh: what the prefill did (:class:`tierkv.materialize.MaterializeResult`), how
    the document was kept (``mode``) and which files changed."""

    result: Any
    mode: str
    changes: Changes

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {"mode": self.mode, **self.changes.as_dict(), "tokens": r.tokens, "kept_tokens": r.cached_tokens,
                "recomputed_tokens": r.computed_tokens, "elapsed_s": round(r.elapsed_s, 3)}

    def line(self, name: str) -> str:
        """One line for ``--watch``."""
        c, r = self.changes, self.result
        files = ", ".join([*(f"~{p}" for p in c.changed), *(f"+{p}" for p in c.added), *(f"-{p}" for p in c.removed)])
        return (f"{name}: {files or 'no change'}; {r.cached_tokens:,} tokens kept, {r.computed_tokens:,} recomputed, "
                f"{r.elapsed_s:.2f} s ({self.mode})")


def refresh_prefix(store: "StoreAPI", lm: "LoadedModel", name: str, *, paths: Sequence[Any] | None = None,
                   options: DocumentOptions | None = None, mode: str = "append",
                   max_stale: float = DEFAULT_MAX_STALE, chunk_tokens: int | None = None, pin: bool | None = None,
                   progress: Any = None, on_warning: Any = None) -> RefreshResult:
    """Bring the named prefix ``name`` up to date with its files (``paths`` and ``options``:
    default, those its manifest recorded) and save its manifest. NotFoundError for an unknown
    name, ModelVersionMismatchError / LayoutMismatchError when ``lm`` did not make it."""
    previous = store.get_manifest(name)
    check_prefix_model(name, previous, lm)
    roots = list(paths) if paths else list(previous["roots"])
    if options is None:
        options = DocumentOptions.from_dict(previous.get("options", {}))
    max_tokens = previous.get("max_tokens")
    arranged = refresh(store, lm, previous, build_document(roots, options, on_warning=on_warning), options,
                       mode=mode, max_stale=max_stale, max_tokens=max_tokens)
    tokens = check_length(lm, arranged.tokens, max_tokens)
    last = previous.get("last_block_key")
    if arranged.mode in ("reorder", "compact") and previous.get("pinned") and last:
        # The superseded chain goes back to the eviction policy; the part the new document
        # keeps is pinned again by the prefill below.
        store.set_priority_from(bytes.fromhex(last), Priority.NORMAL)
    prefix = PrefixTokens(arranged.document, tokens, len(arranged.tokens), arranged.record)
    extra = {} if chunk_tokens is None else {"chunk_tokens": chunk_tokens}
    result = materialize(store, lm, roots, options, name=name, max_tokens=max_tokens, pin=pin,
                         namespace=str(previous.get("namespace", "default")), progress=progress,
                         on_warning=on_warning, prefix=prefix, **extra)
    return RefreshResult(result, arranged.mode, arranged.changes)
