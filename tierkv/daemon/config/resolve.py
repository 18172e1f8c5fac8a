"""The daemon's configuration from its sources: flag > environment > file > default.

Precedence (issue #37): a command-line flag beats the environment, which beats the TOML
config file (file.py), which beats the built-in default. Every setting but the quotas (the
file only) has an environment variable: ``TIERKV_`` and its flat name in capitals
(``TIERKV_HOME``, ``TIERKV_DEVICE_BYTES=8GiB``, ``TIERKV_WRITE_THROUGH=0``, lists
comma-separated; keys.py). Mooncake's own ``MC_TCP_BIND_ADDRESS`` is only a default for
``remote.bind``. Only the CLI reads the file and the environment; it hands them to
:func:`resolve` as plain mappings, and :func:`resolve` records where each value came from
(``tierkv config show``).
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ...config import HOME_ENV, SOCKET_ENV, default_home
from ...errors import ConfigError
from ...layout import PageLayout
from .file import read_config_file
from .keys import ENV_PREFIX, FLAT_NAMES, KEYS, convert, env_name, type_of, value_of
from .settings import BIND_ENV, SECTIONS, DaemonConfig, default_socket

CONFIG_ENV = "TIERKV_CONFIG"  # a TOML file read by every command (serve's --config beats it)
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
assert HOME_ENV == ENV_PREFIX + "HOME" and SOCKET_ENV == ENV_PREFIX + "SOCKET"  # the scheme's two oldest
# The settings a command that opens a home in its own process (`--home`, no daemon) takes
# from the same environment and file as the daemon, per store (the daemon's are shared
# between its layouts): the [store] section but the home and the device (its own flags).
DIRECT_KEYS = ("store.device_bytes", "store.host_bytes", "store.disk_bytes", "store.write_through",
               "store.eviction_policy", "store.page_codec", "store.shm_dir")


def env_values(env: Mapping[str, str]) -> dict[str, object]:
    """The settings set in ``env``, by key, read by the field's type (sizes, paths and the
    layout are converted later, as the file's are). An empty variable counts as unset."""
    out: dict[str, object] = {}
    for key in KEYS:
        name = env_name(key)
        raw = env.get(name, "").strip() if name else ""
        if not raw:
            continue
        kind = type_of(key)
        try:
            if kind.startswith("bool"):
                if raw.lower() not in _TRUE | _FALSE:
                    raise ValueError("expected 1/0, true/false, yes/no or on/off")
                out[key] = raw.lower() in _TRUE
            elif kind.startswith("tuple"):
                out[key] = tuple(x.strip() for x in raw.split(",") if x.strip())
            elif kind.startswith("int") and not key.endswith("bytes"):
                out[key] = int(raw)
            elif kind.startswith("float"):
                out[key] = float(raw)
            else:  # text, sizes, paths, the layout
                out[key] = raw
        except ValueError as e:
            raise ConfigError(f"{name}={raw!r}: {e}", hint=f"unset it, or give a value of type {kind}") from None
    return out


def direct_store_options(env: Mapping[str, str]) -> dict[str, object]:
    """StoreConfig options for a store a command opens itself: ``TIERKV_<NAME>`` over the
    file ``$TIERKV_CONFIG``, for DIRECT_KEYS (named as StoreConfig names them: the [store]
    section's names); the command's own flags go over these."""
    values = read_config_file(Path(env[CONFIG_ENV])) if env.get(CONFIG_ENV) else {}
    values.update(env_values(env))
    return {key.split(".", 1)[1]: convert(key, values[key]) for key in DIRECT_KEYS if key in values}


def resolve(flags: Mapping[str, object], file_values: Mapping[str, object], env: Mapping[str, str],
            file_label: str = "file") -> DaemonConfig:
    """Flags (by key; None = not given) over the environment over the config file over the
    defaults; the result's ``sources`` names where each setting's value came from."""
    values: dict[str, object] = {"store.home": default_home(), "server.socket": default_socket()}
    sources: dict[str, str] = {}
    if env.get(BIND_ENV):
        values["remote.bind"], sources["remote.bind"] = env[BIND_ENV], f"env {BIND_ENV}"
    for layer, label in ((file_values, lambda k: file_label), (env_values(env), lambda k: f"env {env_name(k)}"),
                         (flags, lambda k: "flag")):
        for k, v in layer.items():
            if v is not None:
                values[k], sources[k] = v, label(k)
    by_section: dict[str, dict[str, object]] = {name: {} for name in SECTIONS}
    for key, value in values.items():
        section, name = key.split(".", 1)
        by_section[section][name] = convert(key, value)
    built: dict[str, object] = {}
    for name, cls in SECTIONS.items():
        try:
            built[name] = cls(**by_section[name])
        except TypeError as e:
            raise ConfigError(f"bad [{name}] table: {e}", hint="see docs/operations.md, 'Configuration'") from None
        except ValueError as e:
            raise ConfigError(str(e)) from None
    return DaemonConfig(**built, sources={key: sources.get(key, "default") for key in KEYS})


def merge(flags: Mapping[str, object], file_values: Mapping[str, object], env: Mapping[str, str]) -> DaemonConfig:
    """:func:`resolve`'s configuration."""
    return resolve(flags, file_values, env)


def _text(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, PageLayout):
        return value.to_json()
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def shown(cfg: DaemonConfig) -> dict[str, dict[str, dict[str, str]]]:
    """Every setting as text with its source, by section (``{"store": {"host_bytes":
    {"value": ..., "source": ...}}}``): what ``tierkv config show`` prints."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for key in KEYS:
        section, name = key.split(".", 1)
        out.setdefault(section, {})[name] = {"value": _text(value_of(cfg, key)),
                                             "source": cfg.sources.get(key, "default")}
    return out


def flat_flags(flags: Mapping[str, object]) -> dict[str, object]:
    """The CLI's options (named by the flat names: ``host_bytes``) by key (``store.host_bytes``)."""
    return {FLAT_NAMES[name]: value for name, value in flags.items()}

