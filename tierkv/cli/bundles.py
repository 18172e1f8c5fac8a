"""Transfer commands: ``export`` a named prefix to a signed bundle and ``import`` one."""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import click

from ..errors import ConfigError
from ..model_version import default_memo_path
from .common import OPS_STORE_OPTIONS, emit, fmt_bytes, warn
from .keys import keys_option
from .targets import short, target, target_options

if TYPE_CHECKING:
    from ..api import StoreAPI
    from ..layout import PageLayout


@contextlib.contextmanager
def _layout_of_prefix(store: "StoreAPI", name: str, socket_path: Path | None) -> Iterator["StoreAPI"]:
    """The store that holds the prefix ``name`` with its pages: ``store`` itself when it has
    one layout; across several (a home or a daemon serving several models), the store of
    the layout its manifest names (a client of the daemon declaring that layout)."""
    from ..layout import PageLayout
    from .common import connect_daemon
    from ..home.home import Home

    if store.layout is not None:
        yield store
        return
    raw = store.get_manifest(name).get("layout")
    if not isinstance(raw, dict):
        raise ConfigError(f"prefix {name!r} names no page layout, and the store holds several",
                          hint="materialise the prefix again (materialize records its layout)")
    layout = PageLayout.from_dict(raw)
    if isinstance(store, Home):
        yield store.store_for(layout)
        return
    assert socket_path is not None
    with connect_daemon(socket_path, layout) as client:
        yield client


def _daemon_for(socket_path: Path, layout: "PageLayout") -> "contextlib.AbstractContextManager[StoreAPI]":
    """A client of the daemon for a bundle of ``layout``: declaring it when the daemon
    serves it among several, else an operations client (the daemon's only layout, checked
    against the bundle's by import_bundle), as ``--home`` picks the home's store."""
    from ..home.directory import layout_id
    from .common import connect_daemon

    ops = connect_daemon(socket_path)
    if ops.layout is None and layout_id(layout) in ops.layouts:
        ops.close()
        return contextlib.closing(connect_daemon(socket_path, layout))
    return contextlib.closing(ops)


def _import_home(home: Path, layout: "PageLayout") -> Path:
    """Where a bundle of ``layout`` goes in ``home``: the store of that layout when the home
    holds one (a home a daemon serving several models made), else the root (checked against
    the root's layout, as always)."""
    from ..home.directory import find_layouts

    return next((h for h, lo in find_layouts(home) if lo == layout), home)


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
    from ..signing import Keyring
    from ..transfer import export_prefix

    if not output.resolve().parent.is_dir():
        raise click.BadParameter(f"directory {output.parent} does not exist", param_hint="-o/--output")
    keyring = Keyring(keys_dir)
    if not keyring.has_signing_key():
        public = keyring.generate()
        warn(f"created a signing key in {keys_dir}; importers trust your bundles after "
             f"`tierkv keys trust NAME {public.hex()}`")
    with target(home, socket_path) as store, _layout_of_prefix(store, name, socket_path) as source:
        r = export_prefix(source, name, output, signer=keyring.sign)
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
              default=None, help="Trust an unsigned bundle only if every block, recomputed by this "
              "model, matches its page.")
@keys_option
@target_options
def import_cmd(bundle: Path, name: str | None, model_dir: Path | None, force: bool, verify_model: Path | None,
               keys_dir: Path, home: Path, socket_path: Path | None, as_json: bool) -> None:
    """Check the bundle BUNDLE completely, then store its pages and its named prefix.

    The bundle must be signed by a key in the keyring (`tierkv keys trust`), or pass
    --verify-model. A home that does not exist yet is created with the bundle's page layout."""
    import tierkv

    from ..bundle import check_bundle, read_header
    from ..signing import Keyring
    from ..transfer import Trust, check_compatible, check_trust, import_bundle, model_checker
    from ..model_version import model_version

    # Everything is checked before a home is created or touched: the layout (before any
    # page is read), the whole file and who vouches for it, then the model version.
    trust = Trust(keys=tuple(k.public_key for k in Keyring(keys_dir).trusted()),
                  model_check=model_checker(verify_model) if verify_model else None)
    if socket_path is None:
        home = _import_home(home, read_header(bundle).layout)
    if socket_path is None and (home / "index" / "data.mdb").exists():
        layout = tierkv.home_layout(home)
    elif socket_path is None:
        layout = read_header(bundle).layout
    else:
        layout = None  # checked against the daemon's below
    verified = check_bundle(bundle, layout)
    check_trust(verified, trust)
    header = verified.header
    expected = model_version(model_dir, header.layout, memo_path=default_memo_path()) if model_dir else None
    if socket_path is None:
        exists = (home / "index" / "data.mdb").exists()
        check_compatible(header, tierkv.home_layout(home) if exists else header.layout, expected, force)
        store_cm = contextlib.closing(tierkv.open(home, header.layout, **OPS_STORE_OPTIONS))
    else:
        store_cm = _daemon_for(socket_path, header.layout)
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
