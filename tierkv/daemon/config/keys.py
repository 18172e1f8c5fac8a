"""The keys of the daemon's settings: each one's place (``section.name``: ``store.host_bytes``),
its flat name of before the sections (issue #32, item 3), and the conversion of its text.

The flat name is what users already have: the environment variable (``TIERKV_HOST_BYTES``),
the flag (``--host-bytes``) and, deprecated, a top-level key of the file (``host_bytes =``).
Environment variables stay flat: a variable names one setting, and renaming them would break
every unit file and container that sets one, for nothing a reader gains.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from pathlib import Path

from ...config import GiB, MiB
from ...errors import ConfigError
from ...layout import PageLayout
from .settings import SECTIONS, DaemonConfig

# flat name -> key. The quotas never had flat names (a table of the file only).
FLAT_NAMES: dict[str, str] = {
    "home": "store.home", "device": "store.device", "device_bytes": "store.device_bytes",
    "host_bytes": "store.host_bytes", "disk_bytes": "store.disk_bytes", "shm_dir": "store.shm_dir",
    "write_through": "store.write_through", "eviction_policy": "store.eviction_policy",
    "page_codec": "store.page_codec", "warm_at_open": "store.warm_at_open",
    "socket": "server.socket", "pid_file": "server.pid_file", "workers": "server.workers",
    "max_connections": "server.max_connections", "max_inflight": "server.max_inflight",
    "allowed_uids": "access.allowed_uids", "namespace_per_uid": "access.namespace_per_uid",
    "lease_timeout_s": "leases.timeout_s",
    "staging_bytes": "staging.region_bytes", "client_staging_bytes": "staging.per_client_bytes",
    "staging_timeout_s": "staging.timeout_s",
    "layout": "layouts.preload", "max_layouts": "layouts.max_open", "layout_idle_s": "layouts.idle_s",
    "metrics_port": "metrics.port", "metrics_host": "metrics.host",
    **{f"remote_{name}": f"remote.{name}" for name in (
        "master", "metadata_url", "hostname", "bind", "key_prefix", "segment_bytes", "buffer_bytes", "protocol",
        "device_name", "op_timeout_s", "setup_timeout_s", "backoff_max_s")},
    "publish_pinned": "publish.pinned", "publish_materialised": "publish.materialised",
    "publish_puts": "publish.puts", "write_back_evicted": "publish.write_back_evicted",
    "local_only_namespaces": "publish.local_only_namespaces",
}
# Every setting's key, section by section, in the order of its dataclass.
KEYS: tuple[str, ...] = tuple(f"{section}.{f.name}" for section, cls in SECTIONS.items()
                              for f in dataclasses.fields(cls))
FLAT_OF: dict[str, str] = {key: flat for flat, key in FLAT_NAMES.items()}  # key -> flat name
_TYPES: dict[str, str] = {f"{section}.{f.name}": str(f.type) for section, cls in SECTIONS.items()
                          for f in dataclasses.fields(cls)}
assert set(FLAT_OF) <= set(KEYS), sorted(set(FLAT_OF) - set(KEYS))  # a renamed field renames its key here too

ENV_PREFIX = "TIERKV_"


def type_of(key: str) -> str:
    """The field's annotation as written (``"int | None"``)."""
    return _TYPES[key]


def env_name(key: str) -> str | None:
    """The environment variable of ``key`` (``TIERKV_HOST_BYTES``), None for the quotas."""
    flat = FLAT_OF.get(key)
    return None if flat is None else ENV_PREFIX + flat.upper()


def value_of(cfg: DaemonConfig, key: str) -> object:
    section, name = key.split(".", 1)
    return getattr(getattr(cfg, section), name)


def with_values(cfg: DaemonConfig, values: Mapping[str, object], sources: dict[str, str]) -> DaemonConfig:
    """``cfg`` with the settings ``values`` (key -> value) replaced, each section validated
    again, and ``sources`` as where each value came from."""
    by_section: dict[str, dict[str, object]] = {}
    for key, value in values.items():
        section, name = key.split(".", 1)
        by_section.setdefault(section, {})[name] = value
    changes = {s: dataclasses.replace(getattr(cfg, s), **kw) for s, kw in by_section.items()}
    return dataclasses.replace(cfg, **changes, sources=sources)


def closest(name: str, known: list[str]) -> str | None:
    """The known name nearest ``name`` (a typo's fix), or None."""
    near = difflib.get_close_matches(name, known, n=1, cutoff=0.6)
    return near[0] if near else None


def parse_size(value: object) -> int:
    """``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"64k"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    s = str(value).strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if s[-1:] in "kmgt" else s) * mult)
    except ValueError:
        raise ConfigError(f"cannot read size {value!r}", hint="write sizes like 1073741824, 512MiB or 4GiB") from None


def parse_layout(value: object) -> PageLayout:
    """A layout from a mapping, JSON, or ``num_layers=32,num_kv_heads=8,head_dim=128[,block_size=16,dtype=bfloat16]``."""
    try:
        d: dict[str, object]
        if isinstance(value, str):
            s = value.strip()
            d = json.loads(s) if s.startswith("{") else dict(kv.split("=", 1) for kv in s.split(",") if kv)
        elif isinstance(value, Mapping):
            d = dict(value)
        else:
            raise TypeError(f"expected a table or text, got {type(value).__name__}")
        return PageLayout(
            num_layers=int(str(d["num_layers"])), num_kv_heads=int(str(d["num_kv_heads"])),
            head_dim=int(str(d["head_dim"])), block_size=int(str(d.get("block_size", 16))),
            dtype=str(d.get("dtype", "float32")),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"bad layout {value!r}: {e}",
                          hint="give num_layers, num_kv_heads, head_dim (and block_size, dtype)") from None


def convert(key: str, value: object) -> object:
    """A value of the file, the environment or a flag as its field takes it: sizes in bytes,
    paths expanded, the layout parsed, lists as tuples (a single name as a list of one)."""
    name = key.split(".", 1)[1]
    kind = type_of(key)
    if value is None:
        return None
    if name.endswith("bytes"):
        return parse_size(value)
    if kind.startswith("Path"):
        return Path(str(value)).expanduser()
    if kind.startswith("PageLayout"):
        return value if isinstance(value, PageLayout) else parse_layout(value)
    if kind.startswith("tuple"):
        items = [value] if isinstance(value, (str, int)) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        try:
            return tuple(int(x) for x in items) if kind == "tuple[int, ...]" else tuple(str(x) for x in items)
        except ValueError:
            raise ConfigError(f"{key} must be a list of uids (numbers), got {value!r}") from None
    return value
