"""Inspection commands: ``stats``, ``ls`` and ``verify`` (``verify --repair`` is the one
that changes the store: it quarantines corrupt blocks and rebuilds a damaged index)."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..results import Residency, stats_all_namespaces
from .common import emit, fmt_bytes, print_columns, print_table, progress_bar, warn
from .targets import short, target, target_options

if TYPE_CHECKING:
    from ..api import StoreAPI


# ---- stats -----------------------------------------------------------------------------
@click.command()
@target_options
def stats(home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Per-tier capacity, use and hit rate; traffic between tiers; evictions; quarantine.

    Counters describe the process that holds the store: a running daemon with --socket, or,
    without it, the store just opened here (only the disk tier and totals are meaningful)."""
    with target(home, socket_path) as store:
        s = stats_all_namespaces(store).as_dict()  # every page: the output lists every namespace
    if as_json:
        emit(True, s)
        return
    tiers = s["tiers"]
    hit_rate, acquire_rate = s.get("hit_rate_by_tier", {}), s.get("acquire_hit_rate_by_tier", {})
    evictions = s.get("evictions", {})
    print_columns(
        ["tier", "blocks", "used", "capacity", "use %", "lookup hits", "acquire hits", "evictions"],
        [[t, tiers[t]["blocks"], fmt_bytes(tiers[t]["used_bytes"]), fmt_bytes(tiers[t]["capacity_bytes"]),
          f"{100 * tiers[t]['used_bytes'] / tiers[t]['capacity_bytes']:.1f}" if tiers[t]["capacity_bytes"] else "-",
          f"{100 * hit_rate.get(t, 0.0):.1f}%", f"{100 * acquire_rate.get(t, 0.0):.1f}%", evictions.get(t, 0)]
         for t in ("device", "host", "disk")],
    )
    _print_layouts(s)
    click.echo("")
    print_table([
        ("blocks", s.get("blocks", 0)), ("leased blocks", s.get("leased_blocks", 0)),
        ("lookups", s.get("lookups", 0)), ("hit rate", f"{100 * s.get('hit_rate', 0.0):.1f}%"),
        ("acquires", s.get("acquires", 0)), ("acquire hit rate", f"{100 * s.get('acquire_hit_rate', 0.0):.1f}%"),
        ("lookups/s", s.get("lookups_per_s", 0.0)), ("mean lookup ms", s.get("mean_lookup_ms", 0.0)),
        ("promoted", fmt_bytes(s.get("promoted_bytes", 0))), ("demoted", fmt_bytes(s.get("demoted_bytes", 0))),
        ("read through", fmt_bytes(s.get("read_through_bytes", 0))),
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
        s = stats_all_namespaces(store)
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


# ---- verify ----------------------------------------------------------------------------
@click.command()
@click.option("--repair", is_flag=True, help="Quarantine blocks whose page is corrupt (they are dropped from the index); "
              "rebuild a damaged or missing index from the segments first.")
@target_options
@click.pass_context
def verify(ctx: click.Context, repair: bool, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Re-read every disk page and check its checksum, then check the index against the tiers.

    Exits 1 when corruption was found and not repaired, or the integrity check fails."""
    rebuilt_all = _rebuild_if_damaged(home, as_json) if repair and socket_path is None else {}
    rebuilt = rebuilt_all.pop(".", None)  # the root store's; the other layouts' (if any) below
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
    if rebuilt_all:
        out["layouts_rebuilt"] = rebuilt_all
    ok = (not r.corrupt or repair) and integrity_error is None
    out["ok"] = ok
    if as_json:
        emit(True, out)
    else:
        print_table([("pages checked", r.checked), ("corrupt", len(r.corrupt)),
                     ("quarantined", len(r.corrupt) if repair else 0), ("unreadable (I/O errors)", len(r.unreadable)),
                     ("index consistent", integrity_error or "yes")]
                    + ([(f"index rebuilt: {k}", v) for k, v in rebuilt.items()] if rebuilt else [])
                    + [(f"index of {d} rebuilt: blocks", x["rebuilt"]) for d, x in rebuilt_all.items()])
        for key in r.corrupt:
            click.echo(f"  corrupt block {key}")
        if r.corrupt and not repair:
            click.echo("run `tierkv verify --repair` to quarantine the corrupt blocks", err=True)
    if not ok:
        ctx.exit(1)


def _rebuild_if_damaged(home: Path, as_json: bool) -> dict[str, dict[str, Any]]:
    """``verify --repair`` on a home whose index (or the index of one of its layouts'
    stores, ``HOME/layouts/<id>``) cannot be opened: rebuild it from the segments
    (tierkv.repair) before verifying. Returns each rebuilt store's result by its directory
    relative to the home ("." for the root); empty when every index was fine."""
    from ..home.directory import LAYOUTS_DIR
    from ..repair import index_damaged, rebuild_index

    sub = home / LAYOUTS_DIR
    dirs = [home, *sorted(d for d in sub.iterdir() if (d / "segments").is_dir())] if sub.is_dir() else [home]
    out: dict[str, dict[str, Any]] = {}
    for d in dirs:
        why = index_damaged(d)
        if why is None:
            continue
        warn(f"{why}; rebuilding the index from the segments")
        progress, close = progress_bar("rebuilding index", enabled=not as_json)
        try:
            result = rebuild_index(d, progress=progress)
        finally:
            close()
        if result.corrupt or result.unrecoverable:
            warn(f"{result.corrupt} corrupt slots left out; {result.unrecoverable} slots of format-1 segments cannot "
                 "be rebuilt (their blocks are gone)")
        out[str(d.relative_to(home))] = result.to_dict()
    return out
