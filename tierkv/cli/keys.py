"""``tierkv keys``: the signing key ``tierkv export`` signs bundles with, and the public keys
whose bundles ``tierkv import`` trusts (tierkv.keys; docs/operations.md, "Bundles and keys").

    tierkv keys generate            create this user's key (and trust it as "self")
    tierkv keys show                print this user's public key (give it to importers)
    tierkv keys trust NAME KEY      trust bundles signed by KEY (hex, or a file holding it)
    tierkv keys untrust NAME
    tierkv keys list
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, TypeVar

import click

from ..config import KEYS_ENV
from .common import emit

F = TypeVar("F", bound=Callable[..., Any])


def default_keys_dir() -> Path:
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / "tierkv" / "keys"


def keys_option(f: F) -> F:
    return click.option(
        "--keys", "keys_dir", type=click.Path(file_okay=False, path_type=Path), envvar=KEYS_ENV,
        default=default_keys_dir, show_default=f"${KEYS_ENV}, else ~/.config/tierkv/keys",
        help="Keyring: the signing key and the trusted public keys.",
    )(f)


@click.group(name="keys")
def keys_group() -> None:
    """Signing keys for bundles (export signs; import trusts the keys listed here)."""


@keys_group.command(name="generate")
@click.option("--force", is_flag=True, help="Replace an existing signing key.")
@keys_option
@click.option("--json", "as_json", is_flag=True)
def generate(force: bool, keys_dir: Path, as_json: bool) -> None:
    """Create this user's Ed25519 signing key and trust it."""
    from ..signing import Keyring

    public = Keyring(keys_dir).generate(overwrite=force)
    emit(as_json, {"public_key": public.hex(), "keys": str(keys_dir)})


@keys_group.command(name="show")
@keys_option
@click.option("--json", "as_json", is_flag=True)
def show(keys_dir: Path, as_json: bool) -> None:
    """Print this user's public key (what importers pass to `tierkv keys trust`): the
    64 hex characters alone, or one JSON object with --json; `keys trust` takes either."""
    from ..signing import Keyring

    public = Keyring(keys_dir).public_key().hex()
    if as_json:
        emit(True, {"public_key": public})
    else:
        click.echo(public)  # no label: the line itself is what `keys trust` is given


@keys_group.command(name="trust")
@click.argument("name")
@click.argument("key")
@keys_option
def trust(name: str, key: str, keys_dir: Path) -> None:
    """Trust bundles signed by KEY as NAME. KEY: what `tierkv keys show` printed (64 hex
    characters, or its --json object), or a file holding it."""
    from ..signing import Keyring, parse_public_key

    text = Path(key).read_text() if os.path.isfile(key) else key
    path = Keyring(keys_dir).trust(name, parse_public_key(_key_text(text)))
    click.echo(f"trusted {name}: {path}")


def _key_text(text: str) -> str:
    """The hex key in what `keys show` printed: the hex alone, its --json object, or the
    ``public_key  HEX`` row older versions printed (issue #37, item 7)."""
    text = text.strip()
    if text.startswith("{"):
        try:
            value = json.loads(text).get("public_key")
        except (ValueError, AttributeError):
            return text
        return value if isinstance(value, str) else text
    words = text.split()
    return words[1] if len(words) == 2 and words[0] == "public_key" else text


@keys_group.command(name="untrust")
@click.argument("name")
@keys_option
def untrust(name: str, keys_dir: Path) -> None:
    """Stop trusting the key NAME."""
    from ..signing import Keyring

    if not Keyring(keys_dir).untrust(name):
        raise click.ClickException(f"no trusted key named {name!r} in {keys_dir}")
    click.echo(f"untrusted {name}")


@keys_group.command(name="list")
@keys_option
@click.option("--json", "as_json", is_flag=True)
def list_keys(keys_dir: Path, as_json: bool) -> None:
    """The trusted public keys."""
    from ..signing import Keyring

    keys = {k.name: k.hex for k in Keyring(keys_dir).trusted()}
    emit(as_json, {"trusted": keys}, list(keys.items()) or [("trusted", "none")])


def register(group: click.Group) -> None:
    group.add_command(keys_group)
