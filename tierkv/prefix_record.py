"""What a named prefix's manifest records about its document, and how its token ids come back.

A manifest holds no token ids (a long prefix would make it megabytes): it holds the files
it was made from, in the order used (``sources``), the sections a refresh appended since
(``appended``, tierkv.refresh), the ids after its last full block (``tail_tokens``) and a
SHA-256 of all the ids. The ids come back by rebuilding the document from the files in that
order, or, for a document whose older sections are no longer on disk, from the stored
chain and the tail.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from .document import Document
from .errors import NotFoundError
from .identity import as_token_array

if TYPE_CHECKING:
    from .api import StoreAPI


def tokens_sha256(tokens: Sequence[int]) -> str:
    """SHA-256 of token ids as little-endian int32 (the encoding block keys use)."""
    return hashlib.sha256(as_token_array(tokens).tobytes()).hexdigest()


@dataclass(frozen=True)
class Changes:
    """What differs between a named prefix's files (its manifest) and the files now on disk."""

    changed: tuple[str, ...] = ()
    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return bool(self.changed or self.added or self.removed)

    def as_dict(self) -> dict[str, list[str]]:
        return {"changed": list(self.changed), "added": list(self.added), "removed": list(self.removed)}


def current_files(manifest: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Path -> the manifest's entry for the version of each file the prefix now holds, in the
    order those versions appear in it (a file appended later moves to its appended place)."""
    view: dict[str, dict[str, Any]] = {s["path"]: s for s in manifest.get("sources", [])}
    for entry in manifest.get("appended", []):
        view.pop(entry["path"], None)
        if entry.get("change") != "removed":
            view[entry["path"]] = entry
    return view


def diff(manifest: dict[str, Any], document: Document) -> Changes:
    """The files of ``document`` against those the prefix of ``manifest`` holds."""
    held = current_files(manifest)
    now = {f.path: f.sha256 for f in document.files}
    return Changes(
        changed=tuple(p for p in now if p in held and held[p]["sha256"] != now[p]),
        added=tuple(p for p in now if p not in held),
        removed=tuple(p for p in held if p not in now),
    )


def arrange(document: Document, order: Sequence[str]) -> Document:
    """``document`` with its files in ``order`` (paths it holds; the rest follow in the
    document's own order)."""
    at = {f.path: i for i, f in enumerate(document.files)}
    wanted = [at[p] for p in order if p in at]
    seen = set(wanted)
    picks = wanted + [i for i in range(len(document.files)) if i not in seen]
    sections = tuple(document.sections[i] for i in picks)
    return Document("".join(sections), tuple(document.files[i] for i in picks), document.skipped, sections)


def source_entries(document: Document) -> list[dict[str, Any]]:
    return [{"path": f.path, "sha256": f.sha256, "bytes": f.size} for f in document.files]


def stored_tokens(store: "StoreAPI", manifest: dict[str, Any]) -> list[int]:
    """A prefix's token ids from its stored chain and the ids after its last full block that
    the manifest keeps. NotFoundError when the chain is not stored whole, or the ids do not
    hash to the manifest's ``tokens_sha256``."""
    last = manifest.get("last_block_key")
    tokens = [int(t) for t in store.chain_tokens(bytes.fromhex(last)).tokens] if last else []
    tokens += [int(t) for t in manifest.get("tail_tokens", [])]
    if tokens_sha256(tokens) != manifest.get("tokens_sha256"):
        raise NotFoundError("the stored blocks are not the prefix the manifest names")
    return tokens
