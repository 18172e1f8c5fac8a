"""The daemon's settings: one frozen dataclass per section, and :class:`DaemonConfig` of them.

Each section says what it configures and validates its own fields in ``__post_init__``
(issue #32, item 3: the ~50 flat fields were one list a reader had to sort for himself).
A section's name is its table in the config file (``[store]``, ``[server]``, ...) and its
attribute (``cfg.store.host_bytes``); every setting of a section is checked where its
neighbours are, so no check spans two sections.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ...codec import CODECS
from ...config import GiB, MiB
from ...layout import PageLayout
from ...core.policy import DEFAULT_POLICY
from ...core.policy_spec import tier_policies
from ..quotas import Quotas

if TYPE_CHECKING:
    from ...cluster.publish_policy import PublishPolicy
    from ...cluster.remote import RemoteConfig

BIND_ENV = "MC_TCP_BIND_ADDRESS"  # the Mooncake transfer engine's bind address
DEFAULT_BIND = "127.0.0.1"
DEFAULT_MAX_LAYOUTS = 4


def default_socket() -> Path:
    """``$XDG_RUNTIME_DIR/tierkv/tierkv.sock`` (a per-user 0700 directory), else
    ``/tmp/tierkv-<uid>/tierkv.sock`` (the daemon creates the directory 0700)."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "tierkv" if runtime else Path(f"/tmp/tierkv-{os.getuid()}")
    return base / "tierkv.sock"


def _check_sizes(section: str, settings: object, *names: str) -> None:
    # tierkv.config.check_sizes, with the setting named as the file names it (staging.region_bytes)
    for name in names:
        value = getattr(settings, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{section}.{name} must be a non-negative int, got {value!r}")


def _check_positive(section: str, settings: object, *names: str) -> None:
    for name in names:
        if not getattr(settings, name) > 0:
            raise ValueError(f"{section}.{name} must be positive")


def _check_at_least_one(section: str, settings: object, *names: str) -> None:
    for name in names:
        if getattr(settings, name) < 1:
            raise ValueError(f"{section}.{name} must be at least 1")


@dataclass(frozen=True)
class StoreSettings:
    """``[store]``: the home and the stores the daemon opens in it (one per layout): the tier
    budgets they share, and how each keeps pages. The same settings a command that opens a
    home itself takes (tierkv/cli/common.py), but ``home`` and ``device``."""

    home: Path
    device: str | None = None  # cuda:N or cpu; None: cuda:0 when available
    device_bytes: int = 256 * MiB
    host_bytes: int = 1 * GiB
    disk_bytes: int = 16 * GiB
    shm_dir: Path | None = None  # the shared-memory tier files; None: /dev/shm
    write_through: bool = True
    # tierkv/core/policy.py: "arc" (default), "leader", "lru", "lru2" or "mix" for every tier,
    # or per tier (tierkv/core/policy_spec.py): "leader,disk=arc"
    eviction_policy: str = DEFAULT_POLICY
    # tierkv/codec.py: how new homes store pages in the host and disk tiers ("none" or "int8");
    # None: each home's own ("none" for a new one). Read when a layout's store is opened.
    page_codec: str | None = None
    # At start, read back into each layout's device tier what it held when the daemon last
    # stopped (tierkv/core/warm_start.py): the clients' first hits come from memory.
    warm_at_open: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "home", Path(self.home))
        _check_sizes("store", self, "device_bytes", "host_bytes", "disk_bytes")
        try:
            tier_policies(self.eviction_policy)
        except ValueError as e:
            raise ValueError(f"store.{e}") from None
        if self.page_codec is not None and self.page_codec not in CODECS:
            raise ValueError(f"store.page_codec must be one of {CODECS}, got {self.page_codec!r}")


@dataclass(frozen=True)
class ServerSettings:
    """``[server]``: where the daemon listens and how much it serves at once."""

    socket: Path
    pid_file: Path | None = None  # default: next to the socket, "<socket>.pid"
    workers: int = 8  # threads that run store calls (the event loop never does)
    max_connections: int = 256
    max_inflight: int = 32  # concurrent requests per connection

    def __post_init__(self) -> None:
        object.__setattr__(self, "socket", Path(self.socket))
        if len(os.fsencode(self.socket)) >= 108:
            raise ValueError(f"socket path {self.socket} is longer than the 107 bytes AF_UNIX allows")
        _check_at_least_one("server", self, "workers", "max_connections", "max_inflight")

    @property
    def resolved_pid_file(self) -> Path:
        return self.pid_file or self.socket.with_name(self.socket.name + ".pid")


@dataclass(frozen=True)
class AccessSettings:
    """``[access]``: who may connect besides the daemon's own uid, and what each uid sees."""

    allowed_uids: tuple[int, ...] = ()
    namespace_per_uid: bool = False  # prefix every namespace with "uid<N>/" (trusted side)

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_uids", tuple(self.allowed_uids))


@dataclass(frozen=True)
class LeaseSettings:
    """``[leases]``: how long a client's lease lives without a renew."""

    timeout_s: float = 600.0  # a lease not renewed for this long is released

    def __post_init__(self) -> None:
        _check_positive("leases", self, "timeout_s")


@dataclass(frozen=True)
class StagingSettings:
    """``[staging]``: the shared region clients write new pages into before a put commits."""

    region_bytes: int = 256 * MiB  # split 1/layouts.max_open per layout
    per_client_bytes: int = 64 * MiB  # what one connection may hold of it
    # Slots not committed this long after STAGE are taken back (issue #34, item 10): a
    # client writes a put's pages in milliseconds; a minute leaves room for a loaded host.
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _check_sizes("staging", self, "region_bytes", "per_client_bytes")
        _check_positive("staging", self, "timeout_s")


@dataclass(frozen=True)
class LayoutSettings:
    """``[layouts]``: the page layouts (models) served at once; the N in use share each tier
    budget, 1/N each (layouts.py, home/budgets.py)."""

    preload: PageLayout | None = None  # a layout whose store is opened at start (clients declare theirs)
    max_open: int | None = None  # None: 1 with a preload (a one-model daemon), else 4
    idle_s: float = 300.0  # unused this long, a layout's memory share goes to those in use

    def __post_init__(self) -> None:
        _check_positive("layouts", self, "idle_s")
        _check_at_least_one("layouts", self, "resolved_max_open")

    @property
    def resolved_max_open(self) -> int:
        if self.max_open is not None:
            return self.max_open
        return 1 if self.preload is not None else DEFAULT_MAX_LAYOUTS


@dataclass(frozen=True)
class MetricsSettings:
    """``[metrics]``: the Prometheus text endpoint."""

    port: int | None = None  # None: off
    host: str = "127.0.0.1"  # its address (0.0.0.0 where a container publishes the port)

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port < 65536:
            raise ValueError(f"metrics.port must be in [0, 65535], got {self.port}")


@dataclass(frozen=True)
class RemoteSettings:
    """``[remote]``: the cluster's remote tier (docs/cluster.md); off unless ``master`` is given."""

    master: str | None = None  # HOST:PORT of the Mooncake master's RPC service
    metadata_url: str | None = None  # transfer-engine metadata, e.g. http://HOST:8080/metadata
    hostname: str = "127.0.0.1"  # this node's address other nodes reach its segment on
    bind: str | None = None  # MC_TCP_BIND_ADDRESS; None: $MC_TCP_BIND_ADDRESS, else 127.0.0.1
    key_prefix: str = "tierkv/"
    segment_bytes: int = 512 * MiB  # memory this node lends to the cluster pool (0: none)
    buffer_bytes: int = 64 * MiB  # the client's transfer buffer: bounds one batched put or get
    protocol: str = "tcp"
    device_name: str = ""
    op_timeout_s: float = 5.0
    setup_timeout_s: float = 10.0
    backoff_max_s: float = 30.0  # reconnect attempts back off up to this

    def __post_init__(self) -> None:
        if self.master is not None:
            if not self.metadata_url:
                raise ValueError("remote.master needs remote.metadata_url (--remote-metadata-url: the master's "
                                 "metadata server, e.g. http://HOST:8080/metadata)")
            self.tier_config()  # validates the remote settings now, not when the daemon opens

    @property
    def enabled(self) -> bool:
        return self.master is not None

    @property
    def resolved_bind(self) -> str:
        return self.bind or DEFAULT_BIND

    def tier_config(self) -> RemoteConfig | None:
        """The remote tier's :class:`~tierkv.cluster.remote.RemoteConfig` of these settings,
        or None when the daemon runs without one."""
        if self.master is None:
            return None
        from ...cluster.remote import RemoteConfig  # the cluster package only where a cluster is joined

        return RemoteConfig(
            master_address=self.master, metadata_url=str(self.metadata_url), local_hostname=self.hostname,
            key_prefix=self.key_prefix, global_segment_bytes=self.segment_bytes,
            local_buffer_bytes=self.buffer_bytes, protocol=self.protocol, device_name=self.device_name,
            op_timeout_s=self.op_timeout_s, setup_timeout_s=self.setup_timeout_s,
            backoff_max_s=self.backoff_max_s, backoff_initial_s=min(0.5, self.backoff_max_s),
        )


@dataclass(frozen=True)
class PublishSettings:
    """``[publish]``: what this node publishes to the remote tier (tierkv.cluster.PublishPolicy)."""

    pinned: bool = True  # write-through of pinned prefixes
    materialised: bool = True  # write-through of materialised (named) prefixes
    puts: bool = False  # every normal put too
    write_back_evicted: bool = False  # blocks leaving this node's last tier
    local_only_namespaces: tuple[str, ...] = ()  # neither published nor fetched

    def __post_init__(self) -> None:
        object.__setattr__(self, "local_only_namespaces", tuple(self.local_only_namespaces))
        self.policy()

    def policy(self) -> PublishPolicy:
        from ...cluster.publish_policy import PublishPolicy

        return PublishPolicy(publish_pinned=self.pinned, publish_materialised=self.materialised,
                             publish_puts=self.puts, write_back_evicted=self.write_back_evicted,
                             local_only_namespaces=frozenset(self.local_only_namespaces))


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``tierkv serve`` needs, by section. Capacities are bytes; times are seconds."""

    store: StoreSettings
    server: ServerSettings
    access: AccessSettings = field(default_factory=AccessSettings)
    leases: LeaseSettings = field(default_factory=LeaseSettings)
    staging: StagingSettings = field(default_factory=StagingSettings)
    layouts: LayoutSettings = field(default_factory=LayoutSettings)
    quotas: Quotas = field(default_factory=Quotas)  # per-uid limits and timeouts (quotas.py)
    metrics: MetricsSettings = field(default_factory=MetricsSettings)
    remote: RemoteSettings = field(default_factory=RemoteSettings)
    publish: PublishSettings = field(default_factory=PublishSettings)
    # Where each setting's value came from, by key ("store.host_bytes": "flag", "env TIERKV_X",
    # "file PATH", "default"): resolve() fills it; the daemon reports it in its stats
    # (`tierkv config show --socket`).
    sources: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


# Each section's table in the file and attribute of DaemonConfig, in the order `config show` prints them.
SECTIONS: dict[str, type] = {
    "store": StoreSettings, "server": ServerSettings, "access": AccessSettings, "leases": LeaseSettings,
    "staging": StagingSettings, "layouts": LayoutSettings, "quotas": Quotas, "metrics": MetricsSettings,
    "remote": RemoteSettings, "publish": PublishSettings,
}
