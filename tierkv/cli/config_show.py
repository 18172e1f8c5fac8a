"""``tierkv config show``: every setting of the daemon and where its value came from.

The settings are the ones ``tierkv serve`` would start with, resolved as it resolves them
(flag > environment > config file > default, tierkv/daemon/config.py), or, when a daemon is
live on the socket, the ones it runs with (its stats carry them). An explicit ``--home``
shows the local resolution, not a daemon's, unless ``--socket`` is named too (issue #37,
item 1: a flag is never overridden by a daemon the command line did not name).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ..errors import TierKVError
from .serve import build_config, daemon_options, unset_empty_lists


def _from_daemon(socket: Path) -> dict[str, dict[str, str]] | None:
    """The settings a daemon live on ``socket`` runs with, or None when none answers there."""
    import tierkv

    from ..daemon.security import socket_is_live

    if not socket.exists() or not socket_is_live(socket):
        return None
    with tierkv.connect(socket) as client:
        config = (client.stats().get("daemon") or {}).get("config")
    return config if isinstance(config, dict) else None


@click.group(name="config")
def config_group() -> None:
    """The daemon's configuration."""


@config_group.command(name="show")
@daemon_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: {setting: {value, source}}.")
def show(config_file: Path | None, socket_path: Path | None, as_json: bool, **flags: Any) -> None:
    """Print every setting with its value and where it came from (flag, env TIERKV_*, file,
    default): a live daemon's on the socket, else what `tierkv serve` with these options
    would use."""
    from ..daemon.config import shown

    try:
        flags["socket"] = socket_path
        unset_empty_lists(flags)
        cfg = build_config(flags, config_file)
        ctx = click.get_current_context()
        explicit = ParameterSource.COMMANDLINE
        ask = ctx.get_parameter_source("home") is not explicit or ctx.get_parameter_source("socket_path") is explicit
        live = _from_daemon(cfg.socket) if ask else None
    except TierKVError as exc:
        raise click.ClickException(exc.for_command_line()) from exc
    settings = live if live is not None else shown(cfg)
    origin = f"the daemon at {cfg.socket}" if live is not None else "this command line, environment and file"
    if as_json:
        click.echo(json.dumps({"of": origin, "settings": settings}, sort_keys=True))
        return
    click.echo(f"settings of {origin}:")
    width = max(len(k) for k in settings)
    for name, item in settings.items():
        click.echo(f"{name:<{width}}  {item['value'] or '-':<40}  {item['source']}")


def register(group: click.Group) -> None:
    group.add_command(config_group)
