"""``tierkv materialize``: prefill a repository as a named prefix, keep it up to date.

A name made before is *refreshed*, not rebuilt, when the command names it again with the
same files and options (or with ``--refresh NAME``): tierkv.refresh keeps every block the
new document shares with the old one and computes the changed files only. ``--watch``
repeats that whenever the files change, one line per refresh.
"""
from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import click

from ..document import DocumentOptions
from ..hf import DEFAULT_CHUNK_TOKENS, LoadedModel
from ..prefix_record import Changes
from ..refresh import DEFAULT_MAX_STALE, REFRESH_MODES, RefreshResult, refresh_prefix
from .common import emit, home_option, json_option, open_store, progress_bar, socket_option, warn
from .main_job import (check_codec, doc_options, document_options, load_model, model_options, namespace_option,
                       page_codec_option)

if TYPE_CHECKING:
    from ..api import StoreAPI
    from ..materialize import MaterializeResult, PrefixTokens

DEFAULT_DEBOUNCE_MS = 1600  # editors write a file in several steps; one refresh for a save


@click.command()
@click.argument("paths", nargs=-1, type=click.Path(path_type=Path))
@model_options()
@document_options
@click.option("--name", default=None, help="Record a manifest under this name (for `generate --prefix NAME`).")
@click.option("--refresh", "refresh_name", default=None, metavar="NAME",
              help="Bring the prefix NAME up to date with its files, computing only what changed. Without PATHS "
                   "it takes the paths and document options NAME was made with. Naming NAME again with the "
                   "same PATHS and options refreshes it too.")
@click.option("--refresh-mode", type=click.Choice(REFRESH_MODES), default="append", show_default=True,
              help="append: changed files follow the unchanged document as new sections (computes only them); "
                   "reorder: one copy of each file, changed ones moved last (computes from the first changed "
                   "file on).")
@click.option("--max-stale", type=click.FloatRange(0.0, 1.0), default=DEFAULT_MAX_STALE, show_default=True,
              help="With append: the share of the document's bytes that older versions may take before a "
                   "refresh compacts it (reorder).")
@click.option("--watch", is_flag=True,
              help="Then refresh whenever the files change (debounced), one line per refresh; Ctrl-C or SIGTERM "
                   "stops (after the refresh in progress).")
@click.option("--debounce-ms", type=click.IntRange(min=1), default=DEFAULT_DEBOUNCE_MS, show_default=True,
              help="With --watch: wait this long after a change for more changes before refreshing.")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=DEFAULT_CHUNK_TOKENS, show_default=True,
              help="Tokens per prefill chunk; each chunk's full blocks are stored when it completes.")
@click.option("--pin", is_flag=True,
              help="Store the prefix's blocks as pinned (never evicted). Without it a name already pinned stays "
                   "pinned (`tierkv unpin NAME` unpins).")
@namespace_option
@click.option("--no-progress", is_flag=True, help="No progress bar.")
@page_codec_option
@home_option
@socket_option
@json_option
def materialize(paths: tuple[Path, ...], model_dir: Path, dtype: str, block_size: int, device: str | None,
                new_layout: bool, include: tuple[str, ...], exclude: tuple[str, ...], max_file_bytes: int, no_gitignore: bool,
                order: str, max_tokens: int | None, name: str | None, refresh_name: str | None, refresh_mode: str,
                max_stale: float, watch: bool, debounce_ms: int, chunk_tokens: int, pin: bool, namespace: str,
                no_progress: bool, page_codec: str | None, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Prefill the files and trees PATHS into the store as one prefix document.

    Resumable: an interrupted run continues from its last stored chunk, and a repeated
    run does no work. After an edit, the same command (or --refresh NAME) computes only
    what changed."""
    from ..materialize import document_tokens

    if refresh_name and name and refresh_name != name:
        raise click.UsageError("--name and --refresh name different prefixes")
    name = name or refresh_name
    if not paths and not refresh_name:
        raise click.UsageError("pass PATHS to materialise, or --refresh NAME")
    if watch and not name:
        raise click.UsageError("--watch keeps a named prefix up to date: pass --name NAME")
    check_codec(page_codec, socket_path)
    lm = load_model(model_dir, dtype, block_size, device)
    options = doc_options(include, exclude, max_file_bytes, no_gitignore, order)
    # The document first: a missing path or a document too long is an error before the
    # store is opened, so it creates no home (issue #37, item 10).
    prefix = document_tokens(lm, list(paths), options, max_tokens=max_tokens, on_warning=warn) if paths else None
    refresh = dict(mode=refresh_mode, max_stale=max_stale, chunk_tokens=chunk_tokens)
    progress, close_bar = progress_bar("prefill", enabled=not no_progress)
    with open_store(home, lm.layout, socket_path, new_layout=new_layout, page_codec=page_codec) as store:
        try:
            previous = _manifest_or_none(store, name)
            if refresh_name or (previous and prefix and _same_source(previous, lm, paths, options, namespace, max_tokens)):
                done: RefreshResult | MaterializeResult = refresh_prefix(
                    store, lm, str(name), paths=list(paths) or None, options=options if paths else None,
                    pin=True if pin else None, progress=progress, on_warning=warn, **refresh)
            else:
                done = _materialize(store, lm, paths, options, name, max_tokens, pin, namespace, chunk_tokens,
                                    progress, prefix)
        finally:
            close_bar()
        _report(done, name, lm, as_json)
        if watch:
            _watch(store, lm, str(name), debounce_ms, as_json, **refresh)


def _materialize(store: "StoreAPI", lm: LoadedModel, paths: Sequence[Path], options: DocumentOptions,
                 name: str | None, max_tokens: int | None, pin: bool, namespace: str, chunk_tokens: int,
                 progress: Any, prefix: "PrefixTokens | None") -> "MaterializeResult":
    from ..materialize import materialize as run

    return run(store, lm, list(paths), options, name=name, chunk_tokens=chunk_tokens, max_tokens=max_tokens,
               pin=True if pin else None, namespace=namespace, progress=progress, on_warning=warn, prefix=prefix)


def _manifest_or_none(store: "StoreAPI", name: str | None) -> dict[str, Any] | None:
    from ..errors import NotFoundError

    try:
        return store.get_manifest(name) if name else None
    except NotFoundError:
        return None


def _same_source(manifest: dict[str, Any], lm: LoadedModel, paths: Sequence[Path], options: DocumentOptions,
                 namespace: str, max_tokens: int | None) -> bool:
    """Whether ``manifest`` was made from these paths and options by this model: then a run
    refreshes it (with other options it is another document, built anew)."""
    recorded = DocumentOptions.from_dict(manifest.get("options", {}))
    return (manifest.get("model_version") == lm.model_version and manifest.get("namespace") == namespace
            and manifest.get("roots") == [str(Path(p).resolve()) for p in paths]
            and recorded == options and manifest.get("max_tokens") == max_tokens)


def _report(done: "RefreshResult | MaterializeResult", name: str | None, lm: LoadedModel, as_json: bool) -> None:
    result = done.result if isinstance(done, RefreshResult) else done
    mode, changes = (done.mode, done.changes) if isinstance(done, RefreshResult) else ("new", Changes())
    summary = {
        "name": name, "model_version": lm.model_version, "tokens": result.tokens,
        "document_tokens": result.document_tokens, "cached_tokens": result.cached_tokens,
        "computed_tokens": result.computed_tokens, "stored_blocks": result.stored_blocks,
        "files": result.files, "skipped_files": result.skipped, "elapsed_s": round(result.elapsed_s, 3),
        "tokens_per_s": round(result.tokens_per_s, 1), "pinned": result.pinned, "mode": mode, **changes.as_dict(),
    }
    rows = [("prefix", name or "(unnamed)"), ("files", result.files), ("skipped files", result.skipped),
            ("tokens", result.tokens), ("already stored", result.cached_tokens), ("computed", result.computed_tokens),
            ("blocks stored", result.stored_blocks), ("elapsed s", result.elapsed_s), ("tokens/s", result.tokens_per_s)]
    if result.tokens < result.document_tokens:
        rows.append(("cut from", result.document_tokens))
    if mode != "new":
        rows += [("refresh", mode), ("files changed", len(changes.changed)), ("files added", len(changes.added)),
                 ("files removed", len(changes.removed))]
    emit(as_json, summary, rows)


def _watch(store: "StoreAPI", lm: LoadedModel, name: str, debounce_ms: int, as_json: bool, **refresh: Any) -> None:
    """Refresh ``name`` after each debounced batch of changes under its roots, until Ctrl-C."""
    from watchfiles import watch

    from ..errors import TierKVError

    roots = [r for r in store.get_manifest(name)["roots"] if os.path.exists(r)]
    stop = threading.Event()
    # SIGTERM (a supervisor) and Ctrl-C stop the watch once the refresh in progress is done
    # (what it stored stays stored either way; the manifest is saved after the blocks). A
    # SIGINT the shell set to be ignored (a background job) stays ignored.
    catch = [signal.SIGTERM] + ([signal.SIGINT] if signal.getsignal(signal.SIGINT) != signal.SIG_IGN else [])
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in catch}
    click.echo(f"watching {', '.join(roots)} (Ctrl-C stops)", err=True)
    try:
        for _ in watch(*roots, debounce=debounce_ms, stop_event=stop, raise_interrupt=False):
            try:
                done = refresh_prefix(store, lm, name, on_warning=warn, **refresh)
            except TierKVError as exc:  # a file half-written, a document left empty: retry at the next change
                warn(f"refresh of {name!r} failed: {exc}")
                continue
            if done.mode != "unchanged":  # unchanged: only ignored files changed
                click.echo(json.dumps({"name": name, **done.as_dict()}, sort_keys=True) if as_json else done.line(name))
            if stop.is_set():
                break
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo("stopped watching", err=True)


def register(group: click.Group) -> None:
    group.add_command(materialize)
