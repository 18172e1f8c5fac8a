"""The main job: ``generate`` after a prefix, ``model-version`` of a model directory, the
``quickstart`` demo, and the options ``materialize`` (tierkv.cli.materialize) shares.

Each command parses its options, calls the library (tierkv.hf, tierkv.materialize,
tierkv.quickstart) and prints a table, or one JSON object with ``--json``.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import click

from ..codec import CODECS
from ..devices import resolve_device
from ..document import DEFAULT_MAX_FILE_BYTES, DocumentOptions
from ..hf import DEFAULT_BLOCK_SIZE, DTYPE_CHOICES, LoadedModel, SamplingConfig, generate
from ..hf import load_model as _load_model
from ..hf import version_of
from ..model_version import default_memo_path
from .common import emit, home_option, json_option, open_store, open_target, progress_bar, socket_option, warn
from .layouts import check_prefix

if TYPE_CHECKING:
    from ..api import StoreAPI


def model_options(required: bool = True) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        f = click.option("--model", "model_dir", type=click.Path(path_type=Path), required=required,
                         help="Local Hugging Face model directory (nothing is downloaded).")(f)
        f = click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True,
                         help="Dtype to run the model (and store its KV) in; auto = the checkpoint's.")(f)
        f = click.option("--block-size", type=click.IntRange(min=1), default=DEFAULT_BLOCK_SIZE, show_default=True,
                         help="Tokens per block; part of the store's page layout.")(f)
        f = click.option("--device", default=None, help="Torch device for the model [default: cuda if available, else cpu].")(f)
        f = click.option("--new-layout", is_flag=True,
                         help="Make a store for this model's page layout when the home (or daemon) holds stores, "
                              "none of it (else an error names what differs: `tierkv layouts`).")(f)
        return f
    return deco


def document_options(f: Callable[..., Any]) -> Callable[..., Any]:
    f = click.option("--include", multiple=True, help="Keep only files whose path matches this glob (repeatable).")(f)
    f = click.option("--exclude", multiple=True, help="Drop files whose path matches this glob (repeatable).")(f)
    f = click.option("--max-file-bytes", type=click.IntRange(min=1), default=DEFAULT_MAX_FILE_BYTES, show_default=True,
                     help="Skip files larger than this.")(f)
    f = click.option("--no-gitignore", is_flag=True, help="Do not honour .gitignore files.")(f)
    f = click.option("--order", type=click.Choice(["history", "path"]), default="history", show_default=True,
                     help="File order: history puts the files changed most recently last (git: last commit "
                          "time, uncommitted and untracked files after; else mtime), so an edit recomputes "
                          "less; path sorts by path.")(f)
    f = click.option("--max-tokens", type=click.IntRange(min=1), default=None,
                     help="Cut the document to its first N tokens (needed when it exceeds the model's context).")(f)
    return f


def namespace_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option("--namespace", default="default", show_default=True,
                        help="Tenant salt of the block keys: prefixes are shared only within a namespace.")(f)


def doc_options(include: tuple[str, ...], exclude: tuple[str, ...], max_file_bytes: int, no_gitignore: bool,
                order: str) -> DocumentOptions:
    return DocumentOptions(include=include, exclude=exclude, max_file_bytes=max_file_bytes, gitignore=not no_gitignore,
                           order=order)


def quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    # The CLI owns the process: transformers' per-load progress bars and advice would bury
    # tierkv's own output (errors still surface, as tierkv errors).
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def page_codec_option(f: Callable[..., Any]) -> Callable[..., Any]:
    return click.option(
        "--page-codec", type=click.Choice(CODECS), default=None,
        help="How a new home stores pages in its host and disk tiers: none (exact, the default) or int8 "
             "(about half of bfloat16's bytes, lossy: docs/performance-history.md). A home keeps the codec it was "
             "created with; naming another is an error. Not with --socket (the daemon's --page-codec).")(f)


def check_codec(page_codec: str | None, socket_path: Path | None) -> None:
    if page_codec and socket_path:
        raise click.UsageError("--page-codec is the daemon's setting (tierkv serve --page-codec): drop it with --socket")


def load_model(model_dir: Path, dtype: str, block_size: int, device: str | None) -> LoadedModel:
    quiet_transformers()
    return _load_model(model_dir, dtype=dtype, block_size=block_size, device=resolve_device(device), memo_path=default_memo_path())


@click.command(name="generate")
@model_options()
@click.option("--prefix", "prefix_name", default=None, help="Start the request with the prefix materialised as NAME.")
@click.option("--prefix-from", "prefix_paths", multiple=True, type=click.Path(path_type=Path),
              help="Start the request with the document of these files/trees (repeatable).")
@document_options
@click.option("--prompt", required=True, help="Text that follows the prefix (tokenized on its own).")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=32, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Sample among the k most likely tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed for sampling.")
@click.option("--no-cache", is_flag=True,
              help="Recompute everything: no KV is read from or written to the store (with --prefix it is opened "
                   "only to read the prefix's manifest).")
@click.option("--no-store-output", is_flag=True,
              help="Do not store the blocks the generated tokens complete (a next turn repeating them misses).")
@click.option("--namespace", default=None,
              help="Tenant salt of the block keys [default: the prefix's namespace, else 'default'].")
@click.option("--no-progress", is_flag=True, help="No progress bar for the prompt's prefill (on stderr).")
@page_codec_option
@home_option
@socket_option
@json_option
def generate_cmd(model_dir: Path, dtype: str, block_size: int, device: str | None, new_layout: bool,
                 prefix_name: str | None,
                 prefix_paths: tuple[Path, ...], include: tuple[str, ...], exclude: tuple[str, ...],
                 max_file_bytes: int, no_gitignore: bool, order: str, max_tokens: int | None, prompt: str,
                 max_new_tokens: int, temperature: float, top_k: int | None, seed: int, no_cache: bool,
                 no_store_output: bool, namespace: str | None, no_progress: bool, page_codec: str | None,
                 home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Generate text after a prefix, restoring what the store holds of it."""
    from ..materialize import document_tokens, load_prefix

    if prefix_name and prefix_paths:
        raise click.UsageError("pass --prefix NAME or --prefix-from PATH, not both")
    check_codec(page_codec, socket_path)
    lm = load_model(model_dir, dtype, block_size, device)
    sampling = SamplingConfig(temperature=temperature, top_k=top_k, seed=seed)
    opts = doc_options(include, exclude, max_file_bytes, no_gitignore, order)

    def request(store: "StoreAPI | None") -> tuple[list[int], str]:
        if prefix_name:
            loaded = load_prefix(store, lm, prefix_name, on_warning=warn)
            return loaded.tokens + lm.encode_prompt(prompt), namespace or loaded.namespace
        if prefix_paths:
            prefix = document_tokens(lm, list(prefix_paths), opts, max_tokens=max_tokens, on_warning=warn).tokens
            return prefix + lm.encode_prompt(prompt), namespace or "default"
        return lm.encode_document(prompt), namespace or "default"

    # A long uncached prefix computes for a while (issue #37, item 8): the prefill's
    # progress on stderr, as materialize shows it; closed before the answer is printed.
    progress, close_bar = progress_bar("prefill", enabled=not no_progress)
    try:
        if no_cache:
            if prefix_name:
                # The prefix's manifest is read from the store; none of its KV is used (the way
                # to compare cached and uncached output of the same request).
                with open_target(home, socket_path) as store:
                    tokens, _ = request(store)
            else:
                tokens, _ = request(None)
            result = generate(lm.model, tokens, max_new_tokens=max_new_tokens, sampling=sampling, progress=progress)
        else:
            if prefix_name:
                # The prefix first, in whichever store holds it: an unknown name or one made
                # with another block size is an error before any store opens for this
                # layout, so a typo creates nothing (issue #37, item 2).
                check_prefix(home, socket_path, prefix_name, lm)
            with open_store(home, lm.layout, socket_path, new_layout=new_layout, page_codec=page_codec) as store:
                tokens, ns = request(store)
                # A full disk does not fail the answer (issue #37, item 3): a warning, and the
                # blocks that do not fit are kept in memory (put_what_fits).
                result = generate(lm.model, tokens, store=store, scope=lm.scope(ns), max_new_tokens=max_new_tokens,
                                  sampling=sampling, store_output=not no_store_output, progress=progress,
                                  on_store_error=warn)
    finally:
        close_bar()
    text = lm.decode(list(result.tokens))
    out = {
        "text": text, "tokens": list(result.tokens), "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens, "new_tokens": len(result.tokens), "stored_blocks": result.stored_blocks,
        "stored_output_blocks": result.stored_output_blocks,
        "ttft_s": round(result.ttft_s, 6), "total_s": round(result.total_s, 6), "model_version": lm.model_version,
    }
    if not as_json:
        click.echo(text)
    emit(as_json, out, None if as_json else [
        ("prompt tokens", result.prompt_tokens), ("cached tokens", result.cached_tokens),
        ("new tokens", len(result.tokens)), ("TTFT s", result.ttft_s), ("total s", result.total_s)])


@click.command(name="model-version")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(DTYPE_CHOICES), default="auto", show_default=True)
@click.option("--block-size", type=click.IntRange(min=1), default=DEFAULT_BLOCK_SIZE, show_default=True)
@json_option
def model_version_cmd(model_dir: Path, dtype: str, block_size: int, as_json: bool) -> None:
    """Print the model-version hash of MODEL_DIR (weights, config, tokenizer, KV layout)."""
    layout, version = version_of(model_dir, dtype=dtype, block_size=block_size, memo_path=default_memo_path())
    if as_json:
        emit(True, {"model_version": version, "layout": layout.to_dict(), "model_dir": str(model_dir)})
    else:
        click.echo(version)


@click.command()
@model_options(required=False)
@click.option("--question", default=None, help="Question asked after the prefix.")
@click.option("--max-tokens", type=click.IntRange(min=64), default=4096, show_default=True, help="Prefix length cap.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=16, show_default=True)
@home_option
@json_option
def quickstart(model_dir: Path | None, dtype: str, block_size: int, device: str | None, new_layout: bool, question: str | None,
               max_tokens: int, max_new_tokens: int, home: Path, as_json: bool) -> None:
    """Build a small model (once), materialise tierkv's own source as a prefix and answer a
    question with and without the cache. With --model, uses your model and --home."""
    from ..quickstart import DEFAULT_QUESTION, ensure_quickstart_model, run_quickstart

    setup_start = time.perf_counter()
    quiet_transformers()
    store_home = home
    if model_dir is None:
        # The demo keeps its own store: its layout would clash with a user's model in HOME.
        demo_dir = home / "quickstart"
        if not (demo_dir / "model" / "config.json").is_file():
            click.echo(f"building the quickstart model under {demo_dir} (once) ...", err=True)
        model_dir, _ = ensure_quickstart_model(demo_dir)
        store_home = demo_dir / "store"
    lm = load_model(model_dir, dtype, block_size, device)
    setup_s = time.perf_counter() - setup_start
    progress, close_bar = progress_bar("materialise tierkv source", enabled=not as_json)
    with open_store(store_home, lm.layout, new_layout=new_layout) as store:
        try:
            r = run_quickstart(store, lm, question=question or DEFAULT_QUESTION, max_tokens=max_tokens,
                               max_new_tokens=max_new_tokens, progress=progress)
        finally:
            close_bar()
    out = {
        "model_dir": str(model_dir), "store_home": str(store_home), "setup_s": round(setup_s, 3),
        "prefix_tokens": r.prefix_tokens, "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
        "materialize_s": round(r.materialize_s, 3), "ttft_cold_s": round(r.ttft_cold_s, 4),
        "ttft_warm_s": round(r.ttft_warm_s, 4), "speedup": round(r.speedup, 1), "identical": r.identical,
        "text": r.text,
    }
    emit(as_json, out, [
        ("tokens cached", r.cached_tokens), ("prompt tokens", r.prompt_tokens),
        ("TTFT cold (recompute)", f"{r.ttft_cold_s * 1000:.0f} ms"), ("TTFT warm (tierkv)", f"{r.ttft_warm_s * 1000:.0f} ms"),
        ("speedup", f"{r.speedup:.1f}x"), ("identical tokens", r.identical)])


def register(group: click.Group) -> None:
    for command in (generate_cmd, model_version_cmd, quickstart):
        group.add_command(command)
