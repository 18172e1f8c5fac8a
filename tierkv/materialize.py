"""Materialising a prefix: prefill a repository document into the store, chunk by chunk.

Each chunk's full blocks are put (durably) as soon as the chunk is computed, so a run that
dies resumes where it stopped: the next run's lookup finds the stored blocks and prefills
only the rest, and a repeated run computes nothing. A named run records a manifest from
which :func:`load_prefix` rebuilds exactly the same token ids later.

A manifest does not hold the token ids themselves (a long prefix would make it megabytes);
it holds the source roots and document options to re-derive them, plus the token count and
a SHA-256 of the ids to prove the re-derivation, the model version they were made under and
the key of the last stored block.
"""
from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .document import Document, DocumentOptions, build_document
from .prefix_record import arrange, diff, source_entries, stored_tokens, tokens_sha256
from .errors import ConfigError, LayoutMismatchError, ModelVersionMismatchError, NotFoundError
from .hf.model import LoadedModel
from .hf.prefill import DEFAULT_CHUNK_TOKENS, Progress, cached_prefill
from .identity import block_keys
from .layout import PageLayout, layout_fix

if TYPE_CHECKING:
    from .api import StoreAPI

MANIFEST_KIND = "prefix"
MANIFEST_FORMAT = 2  # 2: the order it used, appended sections and tail_tokens (tierkv.refresh)


@dataclass(frozen=True)
class PrefixTokens:
    """A document and its token ids, cut to ``max_tokens`` when that was asked for.
    ``record``: how the ids were made, for the manifest (:class:`tierkv.refresh.Arranged`);
    empty for a document prefilled as built."""

    document: Document
    tokens: list[int]
    document_tokens: int  # before any cut
    record: dict[str, Any] = field(default_factory=dict)


def document_tokens(
    lm: LoadedModel,
    paths: Sequence[str | os.PathLike[str]],
    options: DocumentOptions = DocumentOptions(),
    *,
    max_tokens: int | None = None,
    on_warning: Callable[[str], None] | None = None,
    order: Sequence[str] | None = None,
) -> PrefixTokens:
    """Build and tokenize the document of ``paths``; ``order``: the file order a manifest
    recorded (files it does not name follow).

    Raises ConfigError when it is longer than the model's context and ``max_tokens`` does
    not cut it short enough (the message gives both numbers), plus what
    :func:`build_document` raises.
    """
    if max_tokens is not None and max_tokens <= 0:
        raise ConfigError(f"--max-tokens must be positive, got {max_tokens}")
    document = build_document(paths, options, on_warning=on_warning)
    if order is not None:
        document = arrange(document, order)
    tokens = lm.encode_document(document.text)
    return PrefixTokens(document, check_length(lm, tokens, max_tokens), len(tokens))


def check_length(lm: LoadedModel, tokens: list[int], max_tokens: int | None) -> list[int]:
    """``tokens`` cut to ``max_tokens``; ConfigError when they still exceed the model's context."""
    if max_tokens is not None:
        tokens = tokens[:max_tokens]
    limit = lm.context_length
    if limit is not None and len(tokens) > limit:
        raise ConfigError(
            f"the document has {len(tokens)} tokens; the model's context is {limit} tokens",
            hint=f"pass --max-tokens {limit} (or fewer) to cut it, or materialise fewer files",
        )
    return tokens


@dataclass(frozen=True)
class MaterializeResult:
    tokens: int
    document_tokens: int
    cached_tokens: int  # already in the store when the run started
    computed_tokens: int
    stored_blocks: int
    elapsed_s: float
    files: int
    skipped: int
    manifest: dict | None
    pinned: bool  # the prefix's blocks are PINNED (asked for, or kept from the name's manifest)

    @property
    def tokens_per_s(self) -> float:
        return self.computed_tokens / self.elapsed_s if self.elapsed_s > 0 else 0.0


def build_manifest(lm: LoadedModel, prefix: PrefixTokens, roots: Sequence[str | os.PathLike[str]],
                   options: DocumentOptions, max_tokens: int | None, pin: bool, namespace: str = "default",
                   keys: list[bytes] | None = None) -> dict:
    """The manifest of a materialised prefix (see the module docstring for why no token ids);
    ``keys``: the blocks' keys as the store keeps them (StoreAPI.block_keys; default: the
    scope's own)."""
    if keys is None:
        keys = block_keys(prefix.tokens, lm.scope(namespace), lm.layout.block_size)
    stored = len(keys) * lm.layout.block_size
    return {
        "order": options.order,
        "sources": source_entries(prefix.document),
        "appended": [],
        "stale_bytes": 0,
        "document_sha256": prefix.document.sha256,
        **prefix.record,
        "kind": MANIFEST_KIND,
        "format": MANIFEST_FORMAT,
        "model_version": lm.model_version,
        "namespace": namespace,
        "model_dir": str(lm.model_dir.resolve()),
        "layout": lm.layout.to_dict(),
        "tokens": len(prefix.tokens),
        "blocks": len(keys),
        "last_block_key": keys[-1].hex() if keys else None,
        "tokens_sha256": tokens_sha256(prefix.tokens),
        # The ids after the last full block: with the stored chain they give back the ids of
        # a document whose older sections are no longer on disk (tierkv.refresh).
        "tail_tokens": [int(t) for t in prefix.tokens[stored:]],
        "roots": [str(Path(r).resolve()) for r in roots],
        "options": options.to_dict(),
        "max_tokens": max_tokens,
        "pinned": pin,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def materialize(
    store: "StoreAPI",
    lm: LoadedModel,
    paths: Sequence[str | os.PathLike[str]],
    options: DocumentOptions = DocumentOptions(),
    *,
    name: str | None = None,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    max_tokens: int | None = None,
    pin: bool | None = None,
    namespace: str = "default",
    progress: Progress | None = None,
    on_warning: Callable[[str], None] | None = None,
    prefix: PrefixTokens | None = None,
) -> MaterializeResult:
    """Prefill the document of ``paths`` into ``store`` and, with ``name``, save its manifest
    (after the blocks are durable, so a manifest never names blocks that were not stored).
    ``pin=True`` stores the prefix's blocks as PINNED, ``pin=False`` as NORMAL (lowering
    those a pinned manifest of ``name`` had pinned), ``None`` keeps what the manifest named
    ``name`` says (not pinned for a new name): a repeated run changes nothing it was not
    asked to (issue #37, item 5). ``namespace`` is the tenant salt of their keys.
    ``progress(done, total)`` gets token counts. ``prefix``: the document of ``paths``
    already built by :func:`document_tokens` (the CLI builds it before opening the store,
    so a missing path or a document too long creates no home).
    """
    from .store import Priority

    start = time.perf_counter()
    if prefix is None:
        prefix = document_tokens(lm, paths, options, max_tokens=max_tokens, on_warning=on_warning)
    scope = lm.scope(namespace)
    previous = _manifest_or_none(store, name)
    was_pinned = bool(previous and previous.get("pinned"))
    if pin is None:
        pin = was_pinned
    priority = Priority.PINNED if pin else Priority.NORMAL
    result = cached_prefill(
        lm.model, prefix.tokens, store=store, scope=scope, chunk_tokens=chunk_tokens,
        need_logits=False, priority=priority, progress=progress,
    )
    if result.cached_tokens and (pin or was_pinned):
        # Blocks stored by an earlier run keep their priority unless changed here: raised
        # for pin=True, lowered when pin=False unpins a name that was pinned.
        store.set_priority(prefix.tokens, scope, priority)
    manifest = None
    if name is not None:
        manifest = build_manifest(lm, prefix, paths, options, max_tokens, pin, namespace,
                                  keys=store.block_keys(prefix.tokens, scope))
        if previous and all(previous.get(k) == manifest[k] for k in ("tokens_sha256", "model_version", "namespace")):
            manifest["created_at"] = previous.get("created_at", manifest["created_at"])  # the same prefix
        store.save_manifest(name, manifest)
    return MaterializeResult(
        tokens=len(prefix.tokens),
        document_tokens=prefix.document_tokens,
        cached_tokens=result.cached_tokens,
        computed_tokens=result.computed_tokens,
        stored_blocks=result.stored_blocks,
        elapsed_s=time.perf_counter() - start,
        files=len(prefix.document.files),
        skipped=len(prefix.document.skipped),
        manifest=manifest,
        pinned=pin,
    )


def _manifest_or_none(store: "StoreAPI", name: str | None) -> dict | None:
    if name is None:
        return None
    try:
        return store.get_manifest(name)
    except NotFoundError:
        return None


@dataclass(frozen=True)
class LoadedPrefix:
    tokens: list[int]
    namespace: str
    manifest: dict


def check_prefix_model(name: str, manifest: dict[str, Any], lm: LoadedModel) -> None:
    """Raise unless the prefix ``name`` (its ``manifest``) was materialised by ``lm``: its
    page layout first (LayoutMismatchError naming the field, e.g. the block size: a model
    version covers the layout, so a block size of 32 for a prefix made with 16 is no other
    model, issue #37 item 2), then its model version (ModelVersionMismatchError). NotFoundError
    when the manifest is not a prefix."""
    if manifest.get("kind") != MANIFEST_KIND:
        raise NotFoundError(f"manifest {name!r} is not a materialised prefix", hint="list prefixes with `tierkv ls`")
    raw = manifest.get("layout")
    if isinstance(raw, dict):
        try:
            held: PageLayout | None = PageLayout.from_dict(raw)
        except (KeyError, TypeError, ValueError):
            held = None
        if held is not None and held != lm.layout:
            raise LayoutMismatchError(
                f"prefix {name!r} was materialised with another page layout: this request has "
                f"{', '.join(lm.layout.differences(held))}", hint=layout_fix(lm.layout, held, "the prefix"))
    if manifest.get("model_version") != lm.model_version:
        raise ModelVersionMismatchError(
            f"prefix {name!r} was made under model version {str(manifest.get('model_version'))[:16]}…, "
            f"the model in {lm.model_dir} is {lm.model_version[:16]}…"
        )


def stored_prefix_tokens(store: "StoreAPI", name: str, manifest: dict[str, Any], missing: Sequence[str],
                         block_size: int, on_warning: Callable[[str], None] | None = None) -> list[int]:
    """The token ids of prefix ``name`` read back from its stored chain (``chain_tokens`` of
    its last block): what a bundle carries, so an imported prefix serves without its source
    tree at the path it had where it was made (issue #37, item 4). With the ids after the
    last full block that a manifest of format 2 keeps (``tail_tokens``), all of them; before
    that, whole blocks only: a prefix whose last tokens fill no block comes back without them
    (said through ``on_warning``). ConfigError when the chain is not stored whole or is not
    the prefix's."""
    last = manifest.get("last_block_key")
    hint = f"restore {missing[0]}, import the prefix's bundle again, or run `tierkv materialize ... --name {name}`"
    if not last:
        raise ConfigError(f"the sources of prefix {name!r} do not exist: {', '.join(missing)}", hint=hint)
    try:
        tokens = [int(t) for t in store.chain_tokens(bytes.fromhex(last)).tokens]
    except NotFoundError:
        raise ConfigError(f"the sources of prefix {name!r} do not exist ({', '.join(missing)}) and its blocks are "
                          "not all stored", hint=hint) from None
    if tokens_sha256(tokens + [int(t) for t in manifest.get("tail_tokens", [])]) == manifest.get("tokens_sha256"):
        return tokens + [int(t) for t in manifest.get("tail_tokens", [])]  # the tail included (or empty)
        return tokens
    total = int(manifest.get("tokens", 0))
    if len(tokens) != int(manifest.get("blocks", -1)) * block_size or not 0 < total - len(tokens) < block_size:
        raise ConfigError(f"the stored blocks of prefix {name!r} are not the prefix it names", hint=hint)
    if on_warning is not None:
        on_warning(f"prefix {name!r}: its sources are not here ({missing[0]}); using the {len(tokens)} token ids of "
                   f"its stored blocks (its last {total - len(tokens)} tokens fill no block and "
                   "were not stored)")
    return tokens


def load_prefix(
    store: "StoreAPI", lm: LoadedModel, name: str, *, on_warning: Callable[[str], None] | None = None
) -> LoadedPrefix:
    """The prefix materialised as ``name``: token ids re-derived from its sources, and the
    namespace its blocks were stored under. When its sources are not here (an imported
    bundle, made on another machine), the token ids of its stored blocks instead
    (:func:`stored_prefix_tokens`).

    Raises NotFoundError for an unknown name or a manifest that is not a prefix,
    ModelVersionMismatchError when it was made under another model version, and ConfigError
    when its sources changed since (the re-derived ids do not hash the same).
    """
    manifest = store.get_manifest(name)
    check_prefix_model(name, manifest, lm)
    namespace = str(manifest.get("namespace", "default"))
    missing = [r for r in manifest["roots"] if not os.path.exists(r)]
    if missing:
        tokens = stored_prefix_tokens(store, name, manifest, missing, lm.layout.block_size, on_warning)
        return LoadedPrefix(tokens, namespace, manifest)
    changed = ConfigError(f"the sources of prefix {name!r} changed since it was materialised",
                          hint=f"run `tierkv materialize --refresh {name}`")
    options = DocumentOptions.from_dict(manifest.get("options", {}))
    if manifest.get("appended"):
        # A refreshed prefix holds older versions of some files, which are no longer on
        # disk: its ids are those of its stored chain, once its current files are checked.
        if diff(manifest, build_document(manifest["roots"], options, on_warning=on_warning)).any:
            raise changed
        try:
            return LoadedPrefix(stored_tokens(store, manifest), namespace, manifest)
        except NotFoundError:
            raise ConfigError(f"prefix {name!r} holds older versions of its files and its blocks are no longer all "
                              "stored", hint=f"run `tierkv materialize --refresh {name}` (it rebuilds the prefix "
                                             "from the files as they are)") from None
    prefix = document_tokens(lm, manifest["roots"], options, max_tokens=manifest.get("max_tokens"),
                             on_warning=on_warning, order=[s["path"] for s in manifest.get("sources", [])])
    if tokens_sha256(prefix.tokens) != manifest.get("tokens_sha256"):
        raise changed
    return LoadedPrefix(prefix.tokens, namespace, manifest)
