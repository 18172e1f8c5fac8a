"""Daemon configuration: one frozen dataclass, and the merge of its sources.

Precedence (issue #37): a command-line flag beats the environment, which beats the TOML
config file, which beats the built-in default. Every field but ``quotas`` (a table: the
file only) has an environment variable: ``TIERKV_`` and the field's name in capitals
(``TIERKV_HOME``, ``TIERKV_SOCKET``, ``TIERKV_DEVICE_BYTES=8GiB``, ``TIERKV_WRITE_THROUGH=0``,
lists comma-separated). Mooncake's own ``MC_TCP_BIND_ADDRESS`` is only a default for
``remote_bind``. Only the CLI reads the file and the environment; it hands the values to
:func:`resolve` as plain mappings, and :func:`resolve` says where each value came from
(``tierkv config show``).

No page layout is needed: clients declare theirs when they connect and the daemon opens a
store per layout (layouts.py). ``layout`` (``--layout``) only pre-creates one at start.
"""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..codec import CODECS
from ..config import HOME_ENV, SOCKET_ENV, GiB, MiB, check_sizes, default_home
from ..errors import ConfigError
from ..layout import PageLayout
from ..policy import DEFAULT_POLICY, POLICIES
from .quotas import Quotas

BIND_ENV = "MC_TCP_BIND_ADDRESS"  # the Mooncake transfer engine's bind address
DEFAULT_BIND = "127.0.0.1"
DEFAULT_MAX_LAYOUTS = 4


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/tierkv/tierkv.sock`` (a per-user 0700 directory), else
    ``/tmp/tierkv-<uid>/tierkv.sock`` (the daemon creates the directory 0700)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "tierkv" if runtime else Path(f"/tmp/tierkv-{os.getuid()}")
    return base / "tierkv.sock"


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``tierkv serve`` needs. Capacities are bytes; times are seconds."""

    home: Path
    socket: Path
    layout: PageLayout | None = None
    device: str | None = None
    device_bytes: int = 256 * MiB
    host_bytes: int = 1 * GiB
    disk_bytes: int = 16 * GiB
    write_through: bool = True
    eviction_policy: str = DEFAULT_POLICY  # tierkv/policy.py: "arc", "lru", "lru2", "mix" or "leader"
    # tierkv/codec.py: how new homes store pages in the host and disk tiers ("none" or "int8");
    # None: each home's own ("none" for a new one). Read when a layout's store is opened.
    page_codec: str | None = None
    metrics_port: int | None = None  # Prometheus text endpoint; None: off
    metrics_host: str = "127.0.0.1"  # its address (0.0.0.0 where a container publishes the port)
    pid_file: Path | None = None  # default: next to the socket, "<socket>.pid"
    lease_timeout_s: float = 600.0  # a lease not renewed for this long is released
    staging_bytes: int = 256 * MiB  # shared region clients write new pages into
    client_staging_bytes: int = 64 * MiB  # per-connection quota of staging
    # Staging slots not committed this long after STAGE are taken back (issue #34, item 10):
    # a client writes a put's pages in milliseconds; a minute leaves room for a loaded host.
    staging_timeout_s: float = 60.0
    max_connections: int = 256
    max_inflight: int = 32  # concurrent requests per connection
    workers: int = 8  # threads that run store calls (the event loop never does)
    # Page layouts served at once; the N in use share each tier budget, 1/N each (layouts.py).
    # None: 1 when ``layout`` is given (a one-model daemon, as before layouts were declared), else 4.
    max_layouts: int | None = None
    # A layout no connection used for this long gives its memory share to those in use (shares.py).
    layout_idle_s: float = 300.0
    namespace_per_uid: bool = False  # prefix every namespace with "uid<N>/" (trusted side)
    allowed_uids: tuple[int, ...] = ()  # peers besides the daemon's own uid
    quotas: Quotas = field(default_factory=Quotas)  # per-uid limits and timeouts ([quotas] in the file)
    shm_dir: Path | None = None
    # ---- the remote tier (docs/cluster.md); off unless remote_master is given ----
    remote_master: str | None = None  # HOST:PORT of the Mooncake master's RPC service
    remote_metadata_url: str | None = None  # transfer-engine metadata, e.g. http://HOST:8080/metadata
    remote_hostname: str = "127.0.0.1"  # this node's address other nodes reach its segment on
    remote_bind: str | None = None  # MC_TCP_BIND_ADDRESS; None: $MC_TCP_BIND_ADDRESS, else 127.0.0.1
    remote_key_prefix: str = "tierkv/"
    remote_segment_bytes: int = 512 * MiB  # memory this node lends to the cluster pool (0: none)
    remote_buffer_bytes: int = 64 * MiB  # the client's transfer buffer: bounds one batched put or get
    remote_protocol: str = "tcp"
    remote_device_name: str = ""
    remote_op_timeout_s: float = 5.0
    remote_setup_timeout_s: float = 10.0
    remote_backoff_max_s: float = 30.0  # reconnect attempts back off up to this
    # ---- what this node publishes (tierkv.cluster.PublishPolicy) ----
    publish_pinned: bool = True  # write-through of pinned prefixes
    publish_materialised: bool = True  # write-through of materialised (named) prefixes
    publish_puts: bool = False  # every normal put too
    write_back_evicted: bool = False  # blocks leaving this node's last tier
    local_only_namespaces: tuple[str, ...] = ()  # neither published nor fetched
    # Where each field's value came from ("flag", "env TIERKV_X", "file PATH", "default"):
    # resolve() fills it; the daemon reports it in its stats (`tierkv config show --socket`).
    sources: dict[str, str] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home))
        object.__setattr__(self, "socket", Path(self.socket))
        if len(os.fsencode(self.socket)) >= 108:
            raise ValueError(f"socket path {self.socket} is longer than the 107 bytes AF_UNIX allows")
        check_sizes(self, "device_bytes", "host_bytes", "disk_bytes", "staging_bytes", "client_staging_bytes")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"metrics_port must be in [0, 65535], got {self.metrics_port}")
        if self.eviction_policy not in POLICIES:
            raise ValueError(f"eviction_policy must be one of {POLICIES}, got {self.eviction_policy!r}")
        if self.page_codec is not None and self.page_codec not in CODECS:
            raise ValueError(f"page_codec must be one of {CODECS}, got {self.page_codec!r}")
        for name in ("lease_timeout_s", "staging_timeout_s", "layout_idle_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        for name in ("max_connections", "max_inflight", "workers", "resolved_max_layouts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        object.__setattr__(self, "local_only_namespaces", tuple(self.local_only_namespaces))
        if self.remote_master is not None:
            if not self.remote_metadata_url:
                raise ValueError("remote_master needs remote_metadata_url (the master's metadata server, "
                                 "e.g. http://HOST:8080/metadata)")
            self.remote_config()  # validates the remote settings now, not when the daemon opens
        self.publish_policy()

    @property
    def resolved_max_layouts(self) -> int:
        if self.max_layouts is not None:
            return self.max_layouts
        return 1 if self.layout is not None else DEFAULT_MAX_LAYOUTS

    @property
    def remote_enabled(self) -> bool:
        return self.remote_master is not None

    @property
    def resolved_remote_bind(self) -> str:
        return self.remote_bind or DEFAULT_BIND

    def remote_config(self) -> Any:
        """The :class:`~tierkv.cluster.remote.RemoteConfig` of these settings, or None when
        the daemon runs without a remote tier."""
        if self.remote_master is None:
            return None
        from ..cluster.remote import RemoteConfig

        return RemoteConfig(
            master_address=self.remote_master, metadata_url=str(self.remote_metadata_url),
            local_hostname=self.remote_hostname, key_prefix=self.remote_key_prefix,
            global_segment_bytes=self.remote_segment_bytes, local_buffer_bytes=self.remote_buffer_bytes,
            protocol=self.remote_protocol, device_name=self.remote_device_name,
            op_timeout_s=self.remote_op_timeout_s, setup_timeout_s=self.remote_setup_timeout_s,
            backoff_max_s=self.remote_backoff_max_s,
            backoff_initial_s=min(0.5, self.remote_backoff_max_s),
        )

    def publish_policy(self) -> Any:
        from ..cluster.publish_policy import PublishPolicy

        return PublishPolicy(publish_pinned=self.publish_pinned, publish_materialised=self.publish_materialised,
                             publish_puts=self.publish_puts, write_back_evicted=self.write_back_evicted,
                             local_only_namespaces=frozenset(self.local_only_namespaces))

    @property
    def resolved_pid_file(self) -> Path:
        return self.pid_file or self.socket.with_name(self.socket.name + ".pid")


def parse_size(value: int | str) -> int:
    """``1073741824``, ``"1GiB"``, ``"512MiB"``, ``"64k"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    s = str(value).strip().lower().replace("ib", "").replace("b", "")
    mult = {"k": 1 << 10, "m": MiB, "g": GiB, "t": 1 << 40}.get(s[-1:], 1)
    try:
        return int(float(s[:-1] if s[-1:] in "kmgt" else s) * mult)
    except ValueError:
        raise ConfigError(f"cannot read size {value!r}", hint="write sizes like 1073741824, 512MiB or 4GiB") from None


def parse_layout(value: str | Mapping[str, Any]) -> PageLayout:
    """A layout from a mapping, JSON, or ``num_layers=32,num_kv_heads=8,head_dim=128[,block_size=16,dtype=bfloat16]``."""
    try:
        d: dict[str, Any]
        if isinstance(value, str):
            s = value.strip()
            d = json.loads(s) if s.startswith("{") else dict(kv.split("=", 1) for kv in s.split(",") if kv)
        else:
            d = dict(value)
        return PageLayout(
            num_layers=int(d["num_layers"]), num_kv_heads=int(d["num_kv_heads"]), head_dim=int(d["head_dim"]),
            block_size=int(d.get("block_size", 16)), dtype=str(d.get("dtype", "float32")),
        )
    except (KeyError, ValueError, TypeError) as e:
        raise ConfigError(f"bad layout {value!r}: {e}",
                          hint="give num_layers, num_kv_heads, head_dim (and block_size, dtype)") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """The TOML file as a flat dict of DaemonConfig fields (``[layout]`` becomes ``layout``)."""
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    data = dict(raw.pop("daemon", {}))
    remote = raw.pop("remote", None)
    data.update(raw)
    if remote is not None:
        # [remote] master = "..." is remote_master = "..."; publish keys keep their names.
        if not isinstance(remote, dict):
            raise ConfigError(f"{path}: 'remote' must be a table")
        for k, v in remote.items():
            data[k if k in _PUBLISH_KEYS else f"remote_{k}"] = v
    known = {f.name for f in fields(DaemonConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(f"unknown keys in {path}: {', '.join(unknown)}", hint=f"known keys: {', '.join(sorted(known))}")
    return data


REMOTE_FIELDS = ("remote_master", "remote_metadata_url", "remote_hostname", "remote_bind", "remote_key_prefix",
                 "remote_segment_bytes", "remote_buffer_bytes", "remote_protocol", "remote_device_name",
                 "remote_op_timeout_s", "remote_setup_timeout_s", "remote_backoff_max_s", "publish_pinned",
                 "publish_materialised", "publish_puts", "write_back_evicted", "local_only_namespaces")
_SIZES = ("device_bytes", "host_bytes", "disk_bytes", "staging_bytes", "client_staging_bytes",
          "remote_segment_bytes", "remote_buffer_bytes")
_PUBLISH_KEYS = frozenset({"publish_pinned", "publish_materialised", "publish_puts", "write_back_evicted",
                           "local_only_namespaces"})
_PATHS = ("home", "socket", "pid_file", "shm_dir")


ENV_PREFIX = "TIERKV_"
_NOT_IN_ENV = frozenset({"quotas", "sources"})
_TRUE, _FALSE = frozenset({"1", "true", "yes", "on"}), frozenset({"0", "false", "no", "off"})
assert HOME_ENV == ENV_PREFIX + "HOME" and SOCKET_ENV == ENV_PREFIX + "SOCKET"  # the scheme's two oldest


def env_name(name: str) -> str:
    """The environment variable of DaemonConfig field ``name``."""
    return ENV_PREFIX + name.upper()


def env_values(env: Mapping[str, str]) -> dict[str, Any]:
    """The DaemonConfig fields set in ``env``, converted by the field's type (sizes and
    paths are converted later, as the file's are). An empty variable counts as unset."""
    out: dict[str, Any] = {}
    for f in fields(DaemonConfig):
        raw = env.get(env_name(f.name), "").strip()
        if f.name in _NOT_IN_ENV or not raw:
            continue
        kind = str(f.type)
        try:
            if kind.startswith("bool"):
                if raw.lower() not in _TRUE | _FALSE:
                    raise ValueError("expected 1/0, true/false, yes/no or on/off")
                out[f.name] = raw.lower() in _TRUE
            elif kind.startswith("tuple"):
                out[f.name] = tuple(x.strip() for x in raw.split(",") if x.strip())
            elif f.name in _SIZES or f.name in _PATHS or f.name == "layout":
                out[f.name] = raw
            elif kind.startswith("int"):
                out[f.name] = int(raw)
            elif kind.startswith("float"):
                out[f.name] = float(raw)
            else:
                out[f.name] = raw
        except ValueError as e:
            raise ConfigError(f"{env_name(f.name)}={raw!r}: {e}", hint=f"unset it, or give a value of type {kind}") from None
    return out


CONFIG_ENV = "TIERKV_CONFIG"  # a TOML file read by every command (serve's --config beats it)
# The settings a command that opens a home in its own process (`--home`, no daemon) takes
# from the same environment and file as the daemon, per store (the daemon's are shared
# between its layouts).
DIRECT_FIELDS = ("device_bytes", "host_bytes", "disk_bytes", "write_through", "eviction_policy", "page_codec",
                 "shm_dir")


def direct_store_options(env: Mapping[str, str]) -> dict[str, Any]:
    """StoreConfig options for a store a command opens itself: ``TIERKV_<NAME>`` over the
    file ``$TIERKV_CONFIG``, for DIRECT_FIELDS; the command's own flags go over these."""
    values = {k: v for k, v in (read_config_file(Path(env[CONFIG_ENV])) if env.get(CONFIG_ENV) else {}).items()
              if k in DIRECT_FIELDS}
    values.update({k: v for k, v in env_values(env).items() if k in DIRECT_FIELDS})
    for k in _SIZES:
        if k in values:
            values[k] = parse_size(values[k])
    if "shm_dir" in values:
        values["shm_dir"] = Path(values["shm_dir"]).expanduser()
    return values


def merge(flags: Mapping[str, Any], file_values: Mapping[str, Any], env: Mapping[str, str]) -> DaemonConfig:
    """:func:`resolve`'s configuration."""
    return resolve(flags, file_values, env)


def resolve(flags: Mapping[str, Any], file_values: Mapping[str, Any], env: Mapping[str, str],
            file_label: str = "file") -> DaemonConfig:
    """Flags (None = not given) over the environment over the config file over the
    defaults; the result's ``sources`` names where each field's value came from."""
    values: dict[str, Any] = {"home": default_home(), "socket": default_socket()}
    sources: dict[str, str] = {}
    if env.get(BIND_ENV):
        values["remote_bind"], sources["remote_bind"] = env[BIND_ENV], f"env {BIND_ENV}"
    for layer, label in ((file_values, lambda k: file_label), (env_values(env), lambda k: f"env {env_name(k)}"),
                         (flags, lambda k: "flag")):
        for k, v in layer.items():
            if v is not None:
                values[k], sources[k] = v, label(k)
    for k in _SIZES:
        if k in values:
            values[k] = parse_size(values[k])
    for k in _PATHS:
        if values.get(k) is not None:
            values[k] = Path(values[k]).expanduser()
    if values.get("layout") is not None and not isinstance(values["layout"], PageLayout):
        values["layout"] = parse_layout(values["layout"])
    if isinstance(values.get("quotas"), Mapping):
        try:
            values["quotas"] = Quotas(**{k: parse_size(v) if k.endswith("_bytes") else v
                                         for k, v in values["quotas"].items()})
        except TypeError as e:
            raise ConfigError(f"bad [quotas] table: {e}", hint="see docs/operations.md, 'Quotas and timeouts'") from None
    if "allowed_uids" in values:
        values["allowed_uids"] = tuple(int(u) for u in values["allowed_uids"])
    if "local_only_namespaces" in values:
        ns = values["local_only_namespaces"]
        values["local_only_namespaces"] = tuple([ns] if isinstance(ns, str) else ns)
    try:
        cfg = DaemonConfig(**values)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None
    cfg.sources.update({f.name: sources.get(f.name, "default") for f in fields(cfg) if f.name not in _NOT_IN_ENV})
    cfg.sources["quotas"] = sources.get("quotas", "default")
    return cfg


def shown(cfg: DaemonConfig) -> dict[str, dict[str, str]]:
    """Every field as text with its source: what ``tierkv config show`` prints."""
    out: dict[str, dict[str, str]] = {}
    for f in fields(cfg):
        if f.name == "sources":
            continue
        value = getattr(cfg, f.name)
        if isinstance(value, PageLayout):
            value = value.to_json()
        elif isinstance(value, Quotas):
            value = json.dumps(dataclasses.asdict(value), sort_keys=True)
        elif isinstance(value, tuple):
            value = ",".join(map(str, value))
        out[f.name] = {"value": "" if value is None else str(value), "source": cfg.sources.get(f.name, "default")}
    return out
