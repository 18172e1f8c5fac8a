"""The daemon's TOML config file: one table per section, and the flat keys of before.

The documented form is nested, a table per section (settings.py)::

    [store]
    host_bytes = "64GiB"
    [layouts.preload]
    num_layers = 32

The flat form of before the sections (issue #32, item 3: ``host_bytes = ...`` at the top or
in a ``[daemon]`` table, ``[layout]``, the publish keys in ``[remote]``) still loads, each
key mapped to its section with a one-line WARNING naming the new key, so that no user's
file breaks on an upgrade; ``[remote]`` and ``[quotas]`` were tables already and keep their
keys. An unknown key, or a section that is not a table, is a ConfigError naming it.
"""
from __future__ import annotations

import logging
import tomllib
from collections.abc import Mapping
from pathlib import Path

from ...errors import ConfigError
from .keys import FLAT_NAMES, KEYS, closest
from .settings import SECTIONS

log = logging.getLogger("tierkv.config")
_PUBLISH_IN_REMOTE = frozenset({"publish_pinned", "publish_materialised", "publish_puts", "write_back_evicted",
                                "local_only_namespaces"})


def read_config_file(path: Path) -> dict[str, object]:
    """The settings of the TOML file at ``path``, by key (``"store.host_bytes": "64GiB"``),
    as written: converted later, with the other sources' (resolve.py)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    daemon = raw.pop("daemon", {})
    if not isinstance(daemon, dict):
        raise ConfigError(f"{path}: 'daemon' must be a table")
    values: dict[str, object] = {}
    for name, value in [*daemon.items(), *raw.items()]:
        if name in SECTIONS:
            _read_section(path, name, value, values)
        elif name in FLAT_NAMES:
            _deprecated(path, name, FLAT_NAMES[name])
            values[FLAT_NAMES[name]] = value
        else:
            raise _unknown(path, name, _top_level_suggestion(name), "settings go in the tables "
                           + ", ".join(f"[{s}]" for s in SECTIONS))
    return values


def _read_section(path: Path, section: str, table: object, values: dict[str, object]) -> None:
    if not isinstance(table, Mapping):
        raise ConfigError(f"{path}: '{section}' must be a table ([{section}])",
                          hint=f"write its settings under [{section}], one per line")
    for name, value in table.items():
        key = f"{section}.{name}"
        if key in KEYS:
            values[key] = value
        elif section == "remote" and name in _PUBLISH_IN_REMOTE:  # where the publish policy was before [publish]
            _deprecated(path, f"[remote] {name}", FLAT_NAMES[name])
            values[FLAT_NAMES[name]] = value
        else:
            known = [k.split(".", 1)[1] for k in KEYS if k.startswith(section + ".")]
            near = closest(name, known)
            raise _unknown(path, key, near and f"{section}.{near}", f"[{section}] takes {', '.join(known)}")


def _deprecated(path: Path, old: str, key: str) -> None:
    section, name = key.split(".", 1)
    log.warning("%s: %r is deprecated: write %s under [%s] (%s)", path, old, name, section, key)


def _top_level_suggestion(name: str) -> str | None:
    # A typo of a flat name is shown its key (host_byte -> store.host_bytes), of a section its table.
    near = closest(name, [*SECTIONS, *FLAT_NAMES])
    if near is None:
        return None
    return FLAT_NAMES.get(near, f"[{near}]")


def _unknown(path: Path, name: str, near: str | None, known: str) -> ConfigError:
    return ConfigError(f"unknown key {name!r} in {path}" + (f" (did you mean {near}?)" if near else ""),
                       hint=f"{known} (docs/operations.md, 'Configuration')")
