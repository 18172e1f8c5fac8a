"""The tierkv daemon (``tierkv serve``) and its client (``tierkv.connect``).

The public surface: what the rest of tierkv (the CLI, ``tierkv.connect``, the doctor) may
use. Every module outside this package imports these names from ``tierkv.daemon``, never a
submodule (tests/test_imports.py checks it), so the modules below can change shape without
reaching into the rest of the package:

    Daemon                the daemon: opens the home, serves the socket (server.py)
    Client                StoreAPI over the socket, what tierkv.connect returns (client.py)
    DaemonConfig          the daemon's configuration: typed, frozen sections (config/)
    CONFIG_ENV            the environment variable naming the TOML config file
    read_config_file      that file's values, checked
    resolve               flags > environment > file > defaults, as one DaemonConfig
    flat_flags            serve's flags (by their flat names) keyed by setting (store.host_bytes)
    shown                 each setting and where its value came from (config show)
    direct_store_options  the file's and environment's settings that apply to a store a
                          command opens itself (the file is the daemon's, read by every command)
    socket_is_live        whether a daemon answers on a socket path (security.py)
    socket_dir_error      what is unsafe about a socket directory, or None

Each name loads its module on first use: ``import tierkv`` stays free of the daemon, and
``tierkv.connect`` does not load the server.

The modules:

    protocol.py      frame format, limits, opcodes (docs/protocol.md)
    messages.py      one dataclass per message, explicit encode/decode
    routes.py        the dispatch table's entries: an opcode's message and handler, typed together
    server.py        the Daemon: lifecycle, signals; owns the parts below
    serving.py       accepting a connection, its read loop, running each request
    handlers.py      what each request does; owns lease_handlers.py, operation_handlers.py
    operation_handlers.py  the requests across layouts, run on the home as the peer's uid sees it
    workers.py       the worker threads store calls run in; releases queued for them
    reload.py        SIGHUP: the settings in force, applied live or refused
    remote_keeper.py the remote tier (cluster) joined and kept connected
    leases.py        leases and staging slots owned by connections
    security.py      socket directory and path checks, SO_PEERCRED, pid file
    regions.py       the staging region; cleanup of shm left by dead processes
    metrics.py       Prometheus metrics (own registry, 127.0.0.1 only)
    config/          DaemonConfig in sections; flag > environment > TOML file > default
    client.py        Client: the embedded store's API over the socket
    remote_lease.py  DaemonHold (a lease as the daemon holds it) and the client's views of the shared pools

The tenant rules (``namespace_per_uid``) are not here: they are tierkv/home/tenancy.py's,
applied by tierkv/home/tenant.py's TenantView, which the handlers run requests on.
"""
from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .client import Client
    from .config import (CONFIG_ENV, DaemonConfig, direct_store_options, flat_flags, read_config_file, resolve,
                         shown)
    from .security import socket_dir_error, socket_is_live
    from .server import Daemon

# name -> the module that defines it (loaded by __getattr__ on first use)
_PUBLIC = {
    "Daemon": "server", "Client": "client",
    "DaemonConfig": "config", "CONFIG_ENV": "config", "read_config_file": "config", "resolve": "config",
    "shown": "config", "direct_store_options": "config", "flat_flags": "config",
    "socket_is_live": "security", "socket_dir_error": "security",
}

__all__ = ["CONFIG_ENV", "Client", "Daemon", "DaemonConfig", "direct_store_options", "flat_flags", "read_config_file",
           "resolve", "shown", "socket_dir_error", "socket_is_live"]
assert sorted(__all__) == sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value  # later reads skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC))
