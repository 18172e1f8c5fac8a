"""Operations commands: ``invalidate``, ``stats``, ``ls``, ``pin``/``unpin``, ``verify``,
``gc``, ``export`` and ``import``.

Each command opens its target with :func:`open_target` (the home directly, or a running
daemon with ``--socket``), calls the library and prints a table, or one JSON object with
``--json``. The logic lives in the library (tierkv.operations, tierkv.gc, tierkv.bundle).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import click

from ..blocks import Priority
from ..identity import Scope
from ..model_version import default_memo_path
from ..results import Residency
from .common import (
    OPS_STORE_OPTIONS, emit, fmt_bytes, home_option, json_option, print_columns, print_table, progress_bar, socket_option,
    open_target, warn,
)
from .keys import keys_option

if TYPE_CHECKING:
    from ..api import StoreAPI

F = TypeVar("F", bound=Callable[..., Any])


@contextlib.contextmanager
def target(home: Path, socket_path: Path | None, **options: Any) -> Iterator["StoreAPI"]:
    t = open_target(home, socket_path, **options)
    try:
        yield t
    finally:
        t.close()


def target_options(f: F) -> F:
    return home_option(socket_option(json_option(f)))


# ---- formatting ------------------------------------------------------------------------
def short(hex_str: str | None, n: int = 12) -> str:
    return (hex_str or "-")[:n]


def _model_version_of(model_dir: Path, home: Path, store: "StoreAPI") -> str:
    """Model version of ``model_dir`` under the layout of the store (or home) it is used with."""
    from ..model_version import model_version

    import tierkv

    layout = store.layout or tierkv.home_layout(home)  # a client of a daemon serving several: the home's
    return model_version(model_dir, layout, memo_path=default_memo_path())


def _check_model_version(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        Scope(value)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--model-version") from None
    return value.lower()


# ---- invalidate ------------------------------------------------------------------------
@click.command()
@click.option("--model", "model_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Model directory whose blocks to remove (its version under the home's page layout).")
@click.option("--model-version", default=None, help="Model-version hash (64 hex) whose blocks to remove.")
@click.option("--namespace", default=None, help="Namespace whose blocks to remove (with a model: only that model's).")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; change nothing.")
@target_options
def invalidate(model_dir: Path | None, model_version: str | None, namespace: str | None, dry_run: bool,
               home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Remove every block of a model version and/or namespace from every tier.

    Index entries go first, then pages; segment files left empty are deleted. Idempotent."""
    if model_dir is not None and model_version is not None:
        raise click.UsageError("pass --model or --model-version, not both")
    if model_dir is None and model_version is None and namespace is None:
        raise click.UsageError("pass --model DIR, --model-version HEX or --namespace NS")
    model_version = _check_model_version(model_version)
    with target(home, socket_path) as store:
        if model_dir is not None:
            model_version = _model_version_of(model_dir, home, store)
        r = store.invalidate(model_version=model_version, namespace=namespace, dry_run=dry_run)
    out = {"model_version": model_version, "namespace": namespace, "removed_blocks": r.removed_blocks,
           "freed_bytes": r.freed_bytes, "dry_run": r.dry_run}
    emit(as_json, out, [("model version", model_version or "(any)"), ("namespace", namespace or "(any)"),
                        ("blocks to remove" if dry_run else "blocks removed", r.removed_blocks),
                        ("bytes to free" if dry_run else "bytes freed", fmt_bytes(r.freed_bytes))])


# ---- stats -----------------------------------------------------------------------------
@click.command()
@target_options
def stats(home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Per-tier capacity, use and hit rate; traffic between tiers; evictions; quarantine.

    Counters describe the process that holds the store: a running daemon with --socket, or,
    without it, the store just opened here (only the disk tier and totals are meaningful)."""
    with target(home, socket_path) as store:
        s = store.stats().as_dict()
    if as_json:
        emit(True, s)
        return
    tiers = s["tiers"]
    hit_rate = s.get("hit_rate_by_tier", {})
    evictions = s.get("evictions", {})
    print_columns(
        ["tier", "blocks", "used", "capacity", "use %", "hit rate", "evictions"],
        [[t, tiers[t]["blocks"], fmt_bytes(tiers[t]["used_bytes"]), fmt_bytes(tiers[t]["capacity_bytes"]),
          f"{100 * tiers[t]['used_bytes'] / tiers[t]['capacity_bytes']:.1f}" if tiers[t]["capacity_bytes"] else "-",
          f"{100 * hit_rate.get(t, 0.0):.1f}%", evictions.get(t, 0)]
         for t in ("device", "host", "disk")],
    )
    _print_layouts(s)
    click.echo("")
    print_table([
        ("blocks", s.get("blocks", 0)), ("leased blocks", s.get("leased_blocks", 0)),
        ("lookups", s.get("lookups", 0)), ("hit rate", f"{100 * s.get('hit_rate', 0.0):.1f}%"),
        ("lookups/s", s.get("lookups_per_s", 0.0)), ("mean lookup ms", s.get("mean_lookup_ms", 0.0)),
        ("promoted", fmt_bytes(s.get("promoted_bytes", 0))), ("demoted", fmt_bytes(s.get("demoted_bytes", 0))),
        ("quarantined", s.get("quarantined", 0)), ("token mismatches", s.get("token_mismatch", 0)),
        ("disk read path", s.get("disk_read_path", "-")), ("home", s.get("home", str(home))),
    ])


def _print_layouts(s: dict[str, Any]) -> None:
    """A daemon serving several page layouts: the figures of each layout's store."""
    layouts = s.get("layouts") or {}
    if len(layouts) < 2:
        return
    click.echo("")
    print_columns(
        ["layout", "blocks", "device used", "host used", "disk used", "disk capacity"],
        [[lid, ls.get("blocks", 0)] + [fmt_bytes(ls["tiers"][t]["used_bytes"]) for t in ("device", "host", "disk")]
         + [fmt_bytes(ls["tiers"]["disk"]["capacity_bytes"])] for lid, ls in sorted(layouts.items())],
    )


# ---- ls --------------------------------------------------------------------------------
def prefix_rows(store: "StoreAPI") -> list[dict[str, Any]]:
    rows = []
    for name, m in sorted(store.list_manifests().items()):
        last = m.get("last_block_key")
        resident = store.chain_residency(bytes.fromhex(last)) if last else Residency()
        rows.append({
            "name": name, "kind": m.get("kind"), "tokens": m.get("tokens"), "blocks": m.get("blocks"),
            "model_version": m.get("model_version"), "namespace": m.get("namespace", "default"),
            "pinned": bool(m.get("pinned")), "resident": resident.as_dict(),
            "complete": bool(last) and resident.blocks == m.get("blocks"),
            "created_at": m.get("created_at"),
        })
    return rows


@click.command(name="ls")
@target_options
def ls(home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Named prefixes (token count, model version, pinned, blocks per tier), then the model
    versions and namespaces in the store with their block counts."""
    with target(home, socket_path) as store:
        prefixes = prefix_rows(store)
        s = store.stats()
    out = {"prefixes": prefixes, "model_versions": s["model_versions"], "namespaces": s["namespaces"],
           "blocks": s.get("blocks", 0)}
    layouts = s.get("layouts") or {}
    if len(layouts) > 1:  # a daemon serving several models: what each layout's store holds
        out["layouts"] = {lid: {"blocks": ls.get("blocks", 0), "model_versions": ls.get("model_versions", {})}
                          for lid, ls in layouts.items()}
    if as_json:
        emit(True, out)
        return
    if prefixes:
        print_columns(
            ["prefix", "tokens", "model", "pinned", "blocks", "device", "host", "disk", "complete"],
            [[p["name"], p["tokens"] or 0, short(p["model_version"]), p["pinned"], p["blocks"] or 0,
              p["resident"]["device"], p["resident"]["host"], p["resident"]["disk"], p["complete"]]
             for p in prefixes],
        )
    else:
        click.echo("no named prefixes (materialise one with `tierkv materialize ... --name NAME`)")
    click.echo("")
    print_columns(["model version", "blocks"], [[short(mv), n] for mv, n in sorted(s["model_versions"].items())])
    click.echo("")
    print_columns(["namespace", "blocks"], [[ns, n] for ns, n in sorted(s["namespaces"].items())])
    if "layouts" in out:
        click.echo("")
        print_columns(["layout", "model version", "blocks"],
                      [[lid, short(mv), n] for lid, x in sorted(out["layouts"].items())
                       for mv, n in sorted(x["model_versions"].items())])


# ---- pin / unpin -----------------------------------------------------------------------
def _set_pinned(name: str, pinned: bool, home: Path, socket_path: Path | None, as_json: bool) -> None:
    with target(home, socket_path) as store:
        manifest = store.get_manifest(name)
        last = manifest.get("last_block_key")
        changed = 0
        if last:
            changed = store.set_priority_from(bytes.fromhex(last), Priority.PINNED if pinned else Priority.NORMAL)
        # Blocks first, manifest second: the manifest never claims a pin the blocks lack.
        manifest["pinned"] = pinned
        store.save_manifest(name, manifest)
    expected = manifest.get("blocks") or 0
    if changed < expected:
        warn(f"only {changed} of the {expected} blocks of {name!r} are stored; "
             f"run `tierkv materialize ... --name {name}` to complete it")
    emit(as_json, {"name": name, "pinned": pinned, "blocks": changed, "expected_blocks": expected},
         [("prefix", name), ("pinned", pinned), ("blocks changed", changed)])


@click.command()
@click.argument("name")
@target_options
def pin(name: str, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Pin the prefix NAME: its blocks are written to disk and never evicted from it."""
    _set_pinned(name, True, home, socket_path, as_json)


@click.command()
@click.argument("name")
@target_options
def unpin(name: str, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Unpin the prefix NAME: its blocks become evictable again (normal priority)."""
    _set_pinned(name, False, home, socket_path, as_json)


# ---- verify ----------------------------------------------------------------------------
@click.command()
@click.option("--repair", is_flag=True, help="Quarantine blocks whose page is corrupt (they are dropped from the index); "
              "rebuild a damaged or missing index from the segments first.")
@target_options
@click.pass_context
def verify(ctx: click.Context, repair: bool, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Re-read every disk page and check its checksum, then check the index against the tiers.

    Exits 1 when corruption was found and not repaired, or the integrity check fails."""
    rebuilt = _rebuild_if_damaged(home, as_json) if repair and socket_path is None else None
    with target(home, socket_path) as store:
        r = store.verify(repair=repair)
        integrity_error: str | None = None
        # A home opened here checks its index against its tiers; a daemon checks its stores.
        try:
            store.check_integrity()
        except AssertionError as e:
            integrity_error = str(e) or "integrity check failed"
    out = {"checked": r.checked, "corrupt": list(r.corrupt), "repaired": bool(r.repaired and r.corrupt),
           "integrity_checked": True, "integrity_error": integrity_error,
           "index_rebuilt": rebuilt, "unreadable": list(r.unreadable)}
    ok = (not r.corrupt or repair) and integrity_error is None
    out["ok"] = ok
    if as_json:
        emit(True, out)
    else:
        print_table([("pages checked", r.checked), ("corrupt", len(r.corrupt)),
                     ("quarantined", len(r.corrupt) if repair else 0), ("unreadable (I/O errors)", len(r.unreadable)),
                     ("index consistent", integrity_error or "yes")]
                    + ([(f"index rebuilt: {k}", v) for k, v in rebuilt.items()] if rebuilt else []))
        for key in r.corrupt:
            click.echo(f"  corrupt block {key}")
        if r.corrupt and not repair:
            click.echo("run `tierkv verify --repair` to quarantine the corrupt blocks", err=True)
    if not ok:
        ctx.exit(1)


def _rebuild_if_damaged(home: Path, as_json: bool) -> dict[str, Any] | None:
    """``verify --repair`` on a home whose index cannot be opened: rebuild it from the
    segments (tierkv.repair) before verifying. None when the index was fine."""
    from ..repair import index_damaged, rebuild_index

    why = index_damaged(home)
    if why is None:
        return None
    warn(f"{why}; rebuilding the index from the segments")
    progress, close = progress_bar("rebuilding index", enabled=not as_json)
    try:
        result = rebuild_index(home, progress=progress)
    finally:
        close()
    if result.corrupt or result.unrecoverable:
        warn(f"{result.corrupt} corrupt slots left out; {result.unrecoverable} slots of format-1 segments cannot be "
             "rebuilt (their blocks are gone)")
    return result.to_dict()


# ---- gc --------------------------------------------------------------------------------
@click.command()
@click.option("--keep-model", "keep_models", multiple=True, type=click.Path(file_okay=False, exists=True, path_type=Path),
              help="Keep every block of this model directory's version (repeatable).")
@click.option("--keep-model-version", "keep_versions", multiple=True, help="Keep every block of this model version (repeatable).")
@click.option("--keep-namespace", "keep_namespaces", multiple=True, help="Keep every block of this namespace (repeatable).")
@click.option("--dry-run", is_flag=True, help="Report what would be removed; change nothing.")
@target_options
def gc(keep_models: tuple[Path, ...], keep_versions: tuple[str, ...], keep_namespaces: tuple[str, ...], dry_run: bool,
       home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Remove blocks no named prefix or --keep-* option refers to; delete named prefixes
    whose blocks are all gone.

    A block is kept when its (model version, namespace) is a named prefix's, or its model
    version or namespace is given with --keep-*. Everything else goes, so pass
    --keep-model for the model you serve."""
    from ..gc import collect

    versions = [v for v in (_check_model_version(v) for v in keep_versions) if v]
    with target(home, socket_path) as store:
        versions += [_model_version_of(d, home, store) for d in keep_models]
        r = collect(store, versions, keep_namespaces, dry_run=dry_run)
    out = {
        "dry_run": dry_run, "removed_blocks": r.removed_blocks, "freed_bytes": r.freed_bytes,
        "removed": [{"model_version": x.model_version, "namespace": x.namespace, "blocks": x.blocks,
                     "freed_bytes": x.freed_bytes} for x in r.removed],
        "deleted_manifests": list(r.deleted_manifests), "kept_model_versions": sorted(set(versions)),
        "kept_namespaces": sorted(keep_namespaces), "kept_scopes": [list(s) for s in r.kept_scopes],
    }
    if as_json:
        emit(True, out)
        return
    if r.removed:
        print_columns(["model version", "namespace", "blocks", "bytes"],
                      [[short(x.model_version), x.namespace or "(all)", x.blocks, fmt_bytes(x.freed_bytes)]
                       for x in r.removed])
        click.echo("")
    print_table([("blocks to remove" if dry_run else "blocks removed", r.removed_blocks),
                 ("bytes to free" if dry_run else "bytes freed", fmt_bytes(r.freed_bytes)),
                 (f"prefixes {'to delete' if dry_run else 'deleted'}", ", ".join(r.deleted_manifests) or "none")])


# ---- export / import -------------------------------------------------------------------
@click.command(name="export")
@click.argument("name")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True,
              help="Bundle file to write (zstd-compressed).")
@keys_option
@target_options
def export_cmd(name: str, output: Path, keys_dir: Path, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Write the prefix NAME (token ids, pages, checksums, manifest) to a portable bundle,
    signed with this user's key (created on first use; see `tierkv keys`)."""
    from ..keys import Keyring
    from ..transfer import export_prefix

    if not output.resolve().parent.is_dir():
        raise click.BadParameter(f"directory {output.parent} does not exist", param_hint="-o/--output")
    keyring = Keyring(keys_dir)
    if not keyring.has_signing_key():
        public = keyring.generate()
        warn(f"created a signing key in {keys_dir}; importers trust your bundles after "
             f"`tierkv keys trust NAME {public.hex()}`")
    with target(home, socket_path) as store:
        r = export_prefix(store, name, output, signer=keyring.sign)
    emit(as_json, {"name": r.name, "path": str(r.path), "tokens": r.tokens, "blocks": r.blocks,
                   "model_version": r.model_version, "namespace": r.namespace, "file_bytes": r.file_bytes},
         [("prefix", r.name), ("file", str(r.path)), ("tokens", r.tokens), ("blocks", r.blocks),
          ("model version", short(r.model_version)), ("file size", fmt_bytes(r.file_bytes))])


@click.command(name="import")
@click.argument("bundle", type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--name", default=None, help="Name for the prefix [default: the exported name].")
@click.option("--model", "model_dir", type=click.Path(file_okay=False, exists=True, path_type=Path), default=None,
              help="Refuse the bundle unless it was made under this model directory's version.")
@click.option("--force", is_flag=True, help="Import despite another --model version, or over another prefix of that name.")
@click.option("--verify-model", "verify_model", type=click.Path(file_okay=False, exists=True, path_type=Path),
              default=None, help="Trust an unsigned bundle only if a sample of its blocks, recomputed by this "
              "model, matches its pages.")
@keys_option
@target_options
def import_cmd(bundle: Path, name: str | None, model_dir: Path | None, force: bool, verify_model: Path | None,
               keys_dir: Path, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Check the bundle BUNDLE completely, then store its pages and its named prefix.

    The bundle must be signed by a key in the keyring (`tierkv keys trust`), or pass
    --verify-model. A home that does not exist yet is created with the bundle's page layout."""
    import tierkv

    from ..bundle import check_bundle, read_header
    from ..keys import Keyring
    from ..transfer import Trust, check_compatible, check_trust, import_bundle, model_checker
    from ..model_version import model_version

    # Everything is checked before a home is created or touched: the layout (before any
    # page is read), the whole file and who vouches for it, then the model version.
    trust = Trust(keys=tuple(k.public_key for k in Keyring(keys_dir).trusted()),
                  model_check=model_checker(verify_model) if verify_model else None)
    if socket_path is None and (home / "index" / "data.mdb").exists():
        layout = tierkv.home_layout(home)
    elif socket_path is None:
        layout = read_header(bundle).layout
    else:
        layout = None  # checked against the daemon's below
    verified = check_bundle(bundle, layout, trust.sample if trust.model_check else 0)
    check_trust(verified, trust)
    header = verified.header
    expected = model_version(model_dir, header.layout, memo_path=default_memo_path()) if model_dir else None
    if socket_path is None:
        exists = (home / "index" / "data.mdb").exists()
        check_compatible(header, tierkv.home_layout(home) if exists else header.layout, expected, force)
        store_cm = contextlib.closing(tierkv.open(home, header.layout, **OPS_STORE_OPTIONS))
    else:
        store_cm = target(home, socket_path)
    with store_cm as store:
        r = import_bundle(store, bundle, name=name, force=force, model_version=expected, trust=trust, verified=verified)
    for w in r.warnings:
        warn(w)
    if expected is not None and expected != r.model_version:
        warn(f"imported under model version {short(r.model_version)}, not --model's {short(expected)} (--force)")
    emit(as_json, {"name": r.name, "tokens": r.tokens, "blocks": r.blocks, "stored_blocks": r.stored,
                   "skipped_blocks": r.skipped, "durable": r.durable, "model_version": r.model_version,
                   "namespace": r.namespace, "replaced_manifest": r.replaced_manifest},
         [("prefix", r.name), ("tokens", r.tokens), ("blocks stored", r.stored),
          ("blocks already present", r.skipped), ("durable", r.durable), ("model version", short(r.model_version))])


COMMANDS = (invalidate, stats, ls, pin, unpin, verify, gc, export_cmd, import_cmd)


def register(group: click.Group) -> None:
    for command in COMMANDS:
        group.add_command(command)


__all__ = ["COMMANDS", "open_target", "register", "target"]
