"""``tierkv layouts`` (list the page layouts a home holds, ``rm`` one) and the checks before a
command stores pages: :func:`check_prefix` here, and the guard every store open goes through
(:func:`~tierkv.cli.common.require_layout`): a model whose layout the home (or daemon) does
not hold is an error naming what differs, not a new store, unless ``--new-layout`` asks.

Why a guard (issue #37, item 2): one ``generate --block-size 32`` by mistake made a store
that lived forever, halved every tier of the real model in a daemon and counted toward
``max_layouts``. A home with no store yet is the exception: its first model makes the first
layout as before.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..home.directory import layout_id
from ..errors import NotFoundError
from ..layout import PageLayout
from .common import emit, fmt_bytes, held_layouts, print_columns, require_layout
from .targets import target, target_options

if TYPE_CHECKING:
    from ..hf import LoadedModel


def check_prefix(home: Path, socket_path: Path | None, name: str, lm: "LoadedModel") -> None:
    """Before a store is opened for ``lm``: the prefix ``name`` exists in the home (any
    layout) and was made with ``lm``'s layout and model version, else the error naming
    which (NotFoundError, LayoutMismatchError, ModelVersionMismatchError). A home without a
    store is a NotFoundError too, and nothing is created."""
    from ..materialize import check_prefix_model

    with target(home, socket_path) as store:
        manifest = store.get_manifest(name)
    check_prefix_model(name, manifest, lm)


# ---- the commands ------------------------------------------------------------------------
def layout_rows(store: Any) -> list[dict[str, Any]]:
    """One dict per layout of an open target (a daemon client or Home): its id, shape,
    where it lives, its blocks and bytes per tier, its limits (its share of a daemon's
    budgets), model versions and named prefixes."""
    s = store.stats(namespace_limit=1)
    per: dict[str, Any] = s.extra.get("layouts") or {}
    prefixes: dict[str, list[str]] = {}
    for name, m in store.list_manifests().items():
        raw = m.get("layout")
        if isinstance(raw, dict):
            try:
                prefixes.setdefault(layout_id(PageLayout.from_dict(raw)), []).append(name)
            except (KeyError, TypeError, ValueError):
                pass
    rows = []
    for lid, ls in per.items():
        lo = ls.get("layout") or {}
        tiers = ls.get("tiers") or {}
        rows.append({
            "layout_id": lid, "home": ls.get("home"), "dtype": lo.get("dtype"), "block_size": lo.get("block_size"),
            "num_layers": lo.get("num_layers"), "num_kv_heads": lo.get("num_kv_heads"), "head_dim": lo.get("head_dim"),
            "blocks": ls.get("blocks", 0), "model_versions": sorted(ls.get("model_versions") or {}),
            "prefixes": sorted(prefixes.get(lid, [])),
            "used_bytes": {t: tiers.get(t, {}).get("used_bytes", 0) for t in ("device", "host", "disk")},
            "limit_bytes": {t: tiers.get(t, {}).get("capacity_bytes", 0) for t in ("device", "host", "disk")},
        })
    return rows


def _list(home: Path, socket_path: Path | None, as_json: bool) -> None:
    with target(home, socket_path) as store:
        rows = layout_rows(store)
    if as_json:
        emit(True, {"layouts": rows})
        return
    if not rows:
        click.echo("no layouts")
        return
    print_columns(["layout", "dtype", "block size", "blocks", "disk used", "disk limit", "models", "prefixes"],
                  [[r["layout_id"], r["dtype"], r["block_size"], r["blocks"], fmt_bytes(r["used_bytes"]["disk"]),
                    fmt_bytes(r["limit_bytes"]["disk"]), len(r["model_versions"]), ", ".join(r["prefixes"]) or "-"]
                   for r in rows])


@click.group(name="layouts", invoke_without_command=True)
@target_options
@click.pass_context
def layouts(ctx: click.Context, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """The page layouts a home holds (one store each: a model, block size and dtype), with
    their blocks, bytes and limits. `tierkv layouts rm ID` removes one."""
    if ctx.invoked_subcommand is None:
        _list(home, socket_path, as_json)


@layouts.command(name="ls")
@target_options
def ls_cmd(home: Path, socket_path: Path | None, as_json: bool) -> None:
    """List the page layouts (as `tierkv layouts`)."""
    _list(home, socket_path, as_json)


@layouts.command(name="rm")
@click.argument("layout_id")
@click.option("--yes", is_flag=True, help="Remove it even though it holds blocks or named prefixes.")
@target_options
def rm_cmd(layout_id: str, yes: bool, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Remove the layout LAYOUT_ID: its store's blocks, prefixes and files. Through a daemon
    its share of the budgets goes back to the other layouts; refused while clients use it."""
    with target(home, socket_path) as store:
        row = next((r for r in layout_rows(store) if r["layout_id"] == layout_id), None)
        if row is None:
            known = ", ".join(r["layout_id"] for r in layout_rows(store)) or "none"
            raise NotFoundError(f"no layout {layout_id} (known: {known})", hint="list them with `tierkv layouts`")
        if (row["blocks"] or row["prefixes"]) and not yes:
            raise click.ClickException(
                f"layout {layout_id} holds {row['blocks']} blocks ({fmt_bytes(row['used_bytes']['disk'])} on disk) "
                f"and prefixes: {', '.join(row['prefixes']) or 'none'}; pass --yes to remove them")
        r = store.remove_layout(layout_id)
    emit(as_json, {"layout_id": r.layout_id, "removed_blocks": r.removed_blocks, "freed_bytes": r.freed_bytes},
         [("layout removed", r.layout_id), ("blocks removed", r.removed_blocks), ("bytes freed", fmt_bytes(r.freed_bytes))])


def register(group: click.Group) -> None:
    group.add_command(layouts)


__all__ = ["check_prefix", "held_layouts", "layouts", "register", "require_layout"]
