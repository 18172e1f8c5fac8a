"""``tierkv serve``: run the daemon that owns a home and serves clients on a Unix socket.

Thin: parse flags, read the config file and the environment (flag > environment > file >
default, tierkv/daemon/config/), hand a DaemonConfig to :class:`tierkv.daemon.Daemon`.
See docs/operations.md.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import click

from ..codec import CODECS
from ..daemon import CONFIG_ENV, DaemonConfig, flat_flags, read_config_file, resolve
from ..errors import TierKVError
from ..core.policy_spec import tier_policies

log = logging.getLogger("tierkv.serve")


def _policy_spec(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """--eviction-policy checked when it is read, so that a typo is a usage error."""
    if value is not None:
        try:
            tier_policies(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return value


def build_config(flags: dict[str, Any], config_file: Path | None) -> DaemonConfig:
    """The daemon's configuration: ``flags`` (by the options' flat names, ``host_bytes``;
    None = not given) over the environment over the file (also what ``tierkv doctor``
    checks and ``tierkv config show`` prints)."""
    config_file = config_file or (Path(os.environ[CONFIG_ENV]) if os.environ.get(CONFIG_ENV) else None)
    file_values = read_config_file(config_file) if config_file else {}
    return resolve(flat_flags(flags), file_values, os.environ, file_label=f"file {config_file}")


def unset_empty_lists(flags: dict[str, Any]) -> None:
    """A repeatable option not given is an empty tuple to click: not given (None), so that
    the environment's or the file's list applies."""
    for name in ("local_only_namespaces", "allowed_uids"):
        if not flags.get(name):
            flags[name] = None


def check_machine(cfg: DaemonConfig) -> None:
    """Run the doctor's daemon checks (tierkv/doctor.py): log each warning, refuse to start
    (DeploymentError) on a failure: a budget this machine cannot back at all."""
    from ..doctor import FAIL, WARN, daemon_checks
    from ..errors import DeploymentError

    checks = daemon_checks(cfg)
    for c in checks:
        if c.status == WARN:
            log.warning("%s: %s (fix: %s)", c.name, c.detail, c.fix)
    failed = [c for c in checks if c.status == FAIL]
    if failed:
        raise DeploymentError("cannot start: " + "; ".join(f"{c.name}: {c.detail}" for c in failed),
                              hint="; ".join(c.fix for c in failed) + " (`tierkv doctor` lists every check)")


# serve's options but --log-level, shared with the commands that resolve the same configuration
# (`tierkv config show`), so that a flag means the same in each.
_DAEMON_OPTIONS = [
    click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="Store home (default: $TIERKV_HOME, then the config file, then $XDG_DATA_HOME/tierkv, "
                      "then ~/.local/share/tierkv)."),
    click.option("--socket", "socket_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Unix socket (default: $TIERKV_SOCKET, then the config file, then $XDG_RUNTIME_DIR/tierkv/tierkv.sock, "
                      "then /tmp/tierkv-UID/tierkv.sock when XDG_RUNTIME_DIR is unset; the directory is made 0700)."),
    click.option("--config", "config_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
                 help="TOML config file (a table per section, as in docs/operations.md); SIGHUP re-reads it."),
    click.option("--layout", default=None,
                 help="Optional: open a store for this page layout at start (num_layers=..,num_kv_heads=..,head_dim=..,"
                      "block_size=..,dtype=..). Not needed: clients declare their layout when they connect."),
    click.option("--max-layouts", type=int, default=None,
                 help="Page layouts (models) served at once (default 4, or 1 with --layout). The N layouts in use share "
                      "each tier budget, 1/N each; staging is split 1/max-layouts."),
    click.option("--layout-idle", "layout_idle_s", type=float, default=None,
                 help="Seconds after which a layout no client uses gives its device and host share to the layouts in "
                      "use (default 300); it keeps its disk share, and gets the rest back when a client declares it."),
    click.option("--workers", type=int, default=None,
                 help="Threads that run store calls (default 8); disk reads and fsyncs overlap across them."),
    click.option("--device", default=None, help="cuda:N or cpu (default: cuda:0 when available)."),
    click.option("--device-bytes", default=None, help="Device tier budget, shared by the layouts (e.g. 8GiB)."),
    click.option("--host-bytes", default=None, help="Host (shared-memory) tier budget, shared by the layouts."),
    click.option("--disk-bytes", default=None, help="Disk tier budget, shared by the layouts."),
    click.option("--eviction-policy", default=None, callback=_policy_spec, metavar="POLICY|TIER=POLICY,...",
                 help="Victim order of every tier: arc (adaptive, default; 0.36 KB of memory per slot), leader (follows "
                      "the best of exact LRU, LRU-2 and arc shadows: better hits away from arc's trace, ~2.9 KB per "
                      "slot and about twice arc's time per acquire of a long prompt), lru, lru2 or mix; or one per "
                      "tier, e.g. \"leader,disk=arc\" (docs/eviction.md)."),
    click.option("--page-codec", type=click.Choice(CODECS), default=None,
                 help="How new homes store pages in the host and disk tiers: none (exact, default) or int8 (about half "
                      "of bfloat16's bytes, lossy: docs/performance-history.md). A home keeps the codec it was created with."),
    click.option("--staging-bytes", default=None, help="Shared staging region for pages clients put."),
    click.option("--client-staging-bytes", default=None, help="Staging one connection may hold (default 64MiB)."),
    click.option("--write-through/--write-back", default=None,
                 help="Write every put to disk before it is acknowledged (default), or later, on eviction."),
    click.option("--warm-at-open/--no-warm-at-open", default=None,
                 help="At start, read back into the device tier what it held when the daemon last stopped "
                      "(default), so the clients' first hits come from memory."),
    click.option("--max-connections", type=int, default=None, help="Clients connected at once (default 256)."),
    click.option("--max-inflight", type=int, default=None, help="Requests in flight per connection (default 32)."),
    click.option("--lease-timeout", "lease_timeout_s", type=float, default=None,
                 help="Seconds a lease may go without renew before the daemon releases it (default 600)."),
    click.option("--staging-timeout", "staging_timeout_s", type=float, default=None,
                 help="Seconds a client may hold staging slots before committing them; then they are taken back "
                      "and its commit is refused (default 60)."),
    click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics on PORT (of --metrics-host)."),
    click.option("--metrics-host", default=None,
                 help="Address the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 in a container whose port "
                      "is published)."),
    click.option("--pid-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Default: <socket>.pid next to the socket."),
    click.option("--shm-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                 help="Directory of the shared-memory tier files (default /dev/shm)."),
    click.option("--namespace-per-uid/--no-namespace-per-uid", default=None,
                 help="Prefix each client's namespace with its uid (isolates users sharing a daemon)."),
    click.option("--allowed-uid", "allowed_uids", type=int, multiple=True,
                 help="A uid besides the daemon's own that may connect; repeatable."),
    click.option("--remote-master", default=None,
                 help="Join a cluster: the Mooncake master's HOST:PORT (RPC). Without it the daemon is local only."),
    click.option("--remote-metadata-url", default=None,
                 help="The cluster's metadata server, e.g. http://HOST:8080/metadata (the master's own HTTP server)."),
    click.option("--remote-hostname", default=None,
                 help="This node's address on the cluster network, as other nodes reach it (default 127.0.0.1)."),
    click.option("--remote-bind", default=None,
                 help="MC_TCP_BIND_ADDRESS for the transfer engine (default: $MC_TCP_BIND_ADDRESS, else 127.0.0.1)."),
    click.option("--remote-key-prefix", default=None, help="Prefix of this cluster's object names (default tierkv/)."),
    click.option("--remote-segment-bytes", default=None,
                 help="Memory this node lends to the cluster pool (default 512MiB; 0 lends none)."),
    click.option("--remote-buffer-bytes", default=None,
                 help="Transfer buffer of the remote client; bounds one batched put or get (default 64MiB)."),
    click.option("--remote-protocol", default=None, help="Transfer protocol: tcp (default) or rdma."),
    click.option("--remote-device-name", default=None, help="RDMA NIC list for --remote-protocol rdma."),
    click.option("--remote-op-timeout", "remote_op_timeout_s", type=float, default=None,
                 help="Deadline of one remote call, seconds (default 5); past it the tier is marked down."),
    click.option("--remote-setup-timeout", "remote_setup_timeout_s", type=float, default=None,
                 help="Deadline of joining the cluster at start, seconds (default 10)."),
    click.option("--remote-backoff-max", "remote_backoff_max_s", type=float, default=None,
                 help="Longest wait between reconnect attempts while the remote tier is down (default 30 s)."),
    click.option("--publish-pinned/--no-publish-pinned", default=None,
                 help="Write pinned prefixes through to the cluster (default on)."),
    click.option("--publish-materialised/--no-publish-materialised", default=None,
                 help="Write materialised (named) prefixes through to the cluster (default on)."),
    click.option("--publish-puts/--no-publish-puts", default=None,
                 help="Publish every normal put too (default off)."),
    click.option("--write-back-evicted/--no-write-back-evicted", default=None,
                 help="Publish blocks as they leave this node's last tier (default off)."),
    click.option("--local-only-namespace", "local_only_namespaces", multiple=True,
                 help="A namespace that never leaves this node (neither published nor fetched); repeatable."),
]


def daemon_options(fn: Any) -> Any:
    """Apply serve's configuration options (flags of the settings' flat names, keys.py; --config) to ``fn``."""
    for option in reversed(_DAEMON_OPTIONS):
        fn = option(fn)
    return fn


@click.command("serve")
@daemon_options
@click.option("--log-level", default="INFO", show_default=True)
def serve(config_file: Path | None, log_level: str, socket_path: Path | None, **flags: Any) -> None:
    """Run the tierkv daemon: the only process that opens HOME. Commands reach it with
    --socket SOCKET (or $TIERKV_SOCKET), programs with tierkv.connect(SOCKET)."""
    from ..daemon import Daemon

    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    flags["socket"] = socket_path
    unset_empty_lists(flags)
    try:
        cfg = build_config(flags, config_file)
        check_machine(cfg)
        reload = (lambda: build_config(flags, config_file)) if config_file else None
        Daemon(cfg, reload=reload, freeze_heap=True).run()  # this process is the daemon
    except TierKVError as exc:  # also when run as `python -m tierkv.daemon.server`, outside the group
        raise click.ClickException(exc.for_command_line()) from exc


def register(group: click.Group) -> None:
    group.add_command(serve)
