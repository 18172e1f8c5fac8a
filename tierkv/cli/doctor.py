"""``tierkv doctor``: check this machine against a deployment's budgets (tierkv/doctor.py).

The budgets are the ones ``tierkv serve`` would start with (flags, ``--config``, the
environment), or, when a daemon is live on the socket, the ones it runs with. One line
per check (ok / warn / fail) with its fix; ``--json``; exit status 1 when a check fails.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from .keys import keys_option
from .serve import build_config


def _live_daemon(cfg: Any, ask: bool) -> tuple[Any, str, int | None]:
    """``cfg`` with the budgets and home of the daemon live on ``cfg.server.socket`` (when ``ask``
    and one is), the source of the budgets, and that daemon's pid."""
    import tierkv

    from ..daemon import socket_is_live

    if not ask or not cfg.server.socket.exists() or not socket_is_live(cfg.server.socket):
        return cfg, "configuration", None
    with tierkv.connect(cfg.server.socket) as client:
        stats = client.stats()
    daemon = stats.get("daemon") or {}
    budgets = daemon.get("budgets") or {}
    changes: dict[str, Any] = {k: int(budgets[k]) for k in ("device_bytes", "host_bytes", "disk_bytes") if k in budgets}
    if isinstance(stats.get("home"), str):
        changes["home"] = Path(stats["home"])
    store = dataclasses.replace(cfg.store, **changes)
    return dataclasses.replace(cfg, store=store), f"the daemon at {cfg.server.socket}", daemon.get("pid")


@click.command(name="doctor")
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Store home whose file system holds the disk tier (default: as `tierkv serve`).")
@click.option("--socket", "socket_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The daemon's socket (default: as `tierkv serve`). When a daemon is live there, its budgets "
                   "and home are checked.")
@click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
              help="The daemon's TOML config file.")
@click.option("--device", default=None, help="cuda:N or cpu, as `tierkv serve --device`.")
@click.option("--device-bytes", default=None, help="Device tier budget (e.g. 8GiB).")
@click.option("--host-bytes", default=None, help="Host (shared-memory) tier budget.")
@click.option("--disk-bytes", default=None, help="Disk tier budget.")
@click.option("--staging-bytes", default=None, help="Shared staging region.")
@click.option("--shm-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Directory of the shared-memory tier files (default /dev/shm).")
@keys_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of a table.")
def doctor(config_file: Path | None, keys_dir: Path, as_json: bool, socket_path: Path | None, **flags: Any) -> None:
    """Check shared memory, page-locking, the disk tier's file system, CUDA, kvikio, the
    socket's directory and the keyring against the budgets; exit 1 when a check fails."""
    from ..doctor import FAIL, OK, check_keyring, daemon_checks

    cfg = build_config({**flags, "socket": socket_path}, config_file)
    # As for every command (issue #37, item 1): an explicit --home is checked as given,
    # not replaced by the home of a daemon on a socket the command line did not name.
    ctx = click.get_current_context()
    explicit = ParameterSource.COMMANDLINE
    ask = ctx.get_parameter_source("home") is not explicit or ctx.get_parameter_source("socket_path") is explicit
    cfg, source, pid = _live_daemon(cfg, ask)
    checks = [*daemon_checks(cfg, daemon_pid=pid), check_keyring(keys_dir)]
    failed = any(c.status == FAIL for c in checks)
    if as_json:
        click.echo(json.dumps({
            "source": source, "home": str(cfg.store.home), "socket": str(cfg.server.socket),
            "budgets": {"device_bytes": cfg.store.device_bytes, "host_bytes": cfg.store.host_bytes,
                        "disk_bytes": cfg.store.disk_bytes, "staging_bytes": cfg.staging.region_bytes},
            "checks": [c.to_dict() for c in checks], "ok": not failed}, sort_keys=True))
    else:
        click.echo(f"budgets of {source}: home {cfg.store.home}, socket {cfg.server.socket}")
        for c in checks:
            click.echo(f"{c.status:<4}  {c.name:<8}  {c.detail}" + (f" (fix: {c.fix})" if c.status != OK and c.fix else ""))
    if failed:
        click.get_current_context().exit(1)


def register(group: click.Group) -> None:
    group.add_command(doctor)
