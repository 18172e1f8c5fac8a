"""Commands that remove or re-prioritise blocks: ``invalidate``, ``pin``/``unpin`` and ``gc``."""
from __future__ import annotations

from pathlib import Path

import click

from ..blocks import Priority
from .common import emit, fmt_bytes, print_columns, print_table, warn
from .targets import check_model_version, model_versions_of, short, target, target_options


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
    model_version = check_model_version(model_version)
    with target(home, socket_path) as store:
        # A model directory: its version under each layout served (its blocks may be under any).
        versions = model_versions_of(model_dir, home, store) if model_dir is not None else [model_version]
        results = [store.invalidate(model_version=v, namespace=namespace, dry_run=dry_run) for v in versions]
    removed, freed = sum(r.removed_blocks for r in results), sum(r.freed_bytes for r in results)
    out = {"model_version": versions[0] if len(versions) == 1 else None, "model_versions": [v for v in versions if v],
           "namespace": namespace, "removed_blocks": removed, "freed_bytes": freed, "dry_run": dry_run}
    emit(as_json, out, [("model version", ", ".join(v for v in versions if v) or "(any)"),
                        ("namespace", namespace or "(any)"),
                        ("blocks to remove" if dry_run else "blocks removed", removed),
                        ("bytes to free" if dry_run else "bytes freed", fmt_bytes(freed))])


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
    --keep-model for the model you serve. Every named prefix kept is listed. With --socket
    the daemon runs it over every store it serves (every tenant's prefixes are kept; under
    namespace_per_uid only the daemon's user may run it)."""
    from ..gc import collect

    versions = [v for v in (check_model_version(v) for v in keep_versions) if v]
    with target(home, socket_path) as store:
        versions += [v for d in keep_models for v in model_versions_of(d, home, store)]
        if socket_path is not None:
            # In the daemon, not here: a connection sees only its own tenant's manifests and
            # namespaces, so gc through it kept and removed nothing (issue #34, item 5).
            r = store.gc(versions, keep_namespaces, dry_run=dry_run)  # type: ignore[attr-defined]
        else:
            r = collect(store, versions, keep_namespaces, dry_run=dry_run)
    out = {**r.as_dict(), "kept_model_versions": sorted(set(versions)), "kept_namespaces": sorted(keep_namespaces)}
    if as_json:
        emit(True, out)
        return
    if r.removed:
        print_columns(["model version", "namespace", "blocks", "bytes"],
                      [[short(x.model_version), x.namespace or "(all)", x.blocks, fmt_bytes(x.freed_bytes)]
                       for x in r.removed])
        click.echo("")
    if r.kept:
        print_columns(["prefix kept", "model version", "namespace", "blocks stored"],
                      [[k.name, short(k.model_version), k.namespace, k.blocks] for k in r.kept])
        click.echo("")
    print_table([("blocks to remove" if dry_run else "blocks removed", r.removed_blocks),
                 ("bytes to free" if dry_run else "bytes freed", fmt_bytes(r.freed_bytes)),
                 ("prefixes kept", len(r.kept)),
                 (f"prefixes {'to delete' if dry_run else 'deleted'}", ", ".join(r.deleted_manifests) or "none")])
