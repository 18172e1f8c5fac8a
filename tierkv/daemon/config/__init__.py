"""The daemon's configuration: typed sections (settings.py), their keys and the flat names
of before (keys.py), the TOML file (file.py), and the merge of flag > environment > file >
default with each value's source (resolve.py). docs/operations.md, "Configuration".

No page layout is needed: clients declare theirs when they connect and the daemon opens a
store per layout (layouts.py). ``layouts.preload`` (``--layout``) only opens one at start.
"""
from __future__ import annotations

from .file import read_config_file
from .keys import FLAT_NAMES, KEYS, env_name, parse_layout, parse_size
from .resolve import CONFIG_ENV, DIRECT_KEYS, direct_store_options, env_values, flat_flags, merge, resolve, shown
from .settings import (
    BIND_ENV,
    DEFAULT_BIND,
    DEFAULT_MAX_LAYOUTS,
    SECTIONS,
    AccessSettings,
    DaemonConfig,
    LayoutSettings,
    LeaseSettings,
    MetricsSettings,
    PublishSettings,
    RemoteSettings,
    ServerSettings,
    StagingSettings,
    StoreSettings,
    default_socket,
)

__all__ = [
    "BIND_ENV", "CONFIG_ENV", "DEFAULT_BIND", "DEFAULT_MAX_LAYOUTS", "DIRECT_KEYS", "FLAT_NAMES", "KEYS", "SECTIONS",
    "AccessSettings", "DaemonConfig", "LayoutSettings", "LeaseSettings", "MetricsSettings", "PublishSettings",
    "RemoteSettings", "ServerSettings", "StagingSettings", "StoreSettings", "default_socket",
    "direct_store_options", "env_name", "env_values", "flat_flags", "merge", "parse_layout", "parse_size",
    "read_config_file", "resolve", "shown",
]
