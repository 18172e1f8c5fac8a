"""Typed results of store operations (no bare tuples or -1 sentinels across modules).

Every implementation of :class:`tierkv.api.StoreAPI` (the embedded store, the daemon client,
the cluster node) returns these, so a caller never branches on which one it holds.
"""
from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import torch

from .layout import PageLayout, kv_buffer, split_layers, unpack_into

if TYPE_CHECKING:
    from .api import StoreAPI
    from .blocks import Block


@dataclass(frozen=True)
class LookupResult:
    """The longest cached prefix: ``tokens_matched`` is a multiple of the block size."""

    tokens_matched: int
    keys: tuple[bytes, ...]
    tiers: tuple[str, ...]  # where each block was found ("device", "host", "disk")

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class PutResult:
    stored: int  # blocks written by this call
    skipped: int  # blocks already stored (or being stored by another caller)
    durable: bool  # every block of the call is on disk and indexed


@dataclass(frozen=True)
class InvalidateResult:
    removed_blocks: int
    freed_bytes: int
    dry_run: bool = False


@dataclass(frozen=True)
class RemoveLayoutResult:
    """A page layout's store removed from a home (``tierkv layouts rm``): what it held."""

    layout_id: str
    removed_blocks: int
    freed_bytes: int


@dataclass(frozen=True)
class VerifyResult:
    checked: int
    corrupt: tuple[str, ...]  # hex keys whose page failed its checksum or is provably missing
    repaired: bool
    # Hex keys whose page could not be read (an I/O error): not corrupt, never quarantined.
    unreadable: tuple[str, ...] = ()


class ChainTokens(NamedTuple):
    """What a stored chain was made from (``chain_tokens``): its token ids (int32), model
    version and namespace. A NamedTuple so ``tokens, mv, ns = ...`` keeps working."""

    tokens: np.ndarray
    model_version: str
    namespace: str


@dataclass(frozen=True)
class Residency:
    """Blocks of a chain (walked from its last key towards the root) and how many of them
    each tier holds (``chain_residency``). ``blocks`` counts the blocks found, so a chain
    whose middle block is gone shows fewer blocks than its manifest names."""

    blocks: int = 0
    device: int = 0
    host: int = 0
    disk: int = 0

    def as_dict(self) -> dict[str, int]:
        return {"blocks": self.blocks, "device": self.device, "host": self.host, "disk": self.disk}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Residency":
        return cls(int(d["blocks"]), int(d["device"]), int(d["host"]), int(d["disk"]))


@dataclass(frozen=True)
class TierStats:
    """One local tier's occupancy; ``details`` are what the tier itself reports (its shared
    memory path, the disk tier's file bytes and degraded reason, ...)."""

    blocks: int
    used_bytes: int
    capacity_bytes: int
    details: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {**self.details, "blocks": self.blocks, "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TierStats":
        rest = {k: v for k, v in d.items() if k not in ("blocks", "used_bytes", "capacity_bytes")}
        return cls(int(d["blocks"]), int(d["used_bytes"]), int(d["capacity_bytes"]), rest)


@dataclass(frozen=True)
class CounterStats:
    """Traffic since the store was opened (see :class:`tierkv.stats.Counters`). Per-tier
    maps are keyed by tier name ("device", "host", "disk"; a cluster node adds "remote")."""

    lookups: int = 0
    lookup_blocks: int = 0
    hits: Mapping[str, int] = field(default_factory=dict)
    hit_rate: float = 0.0
    hit_rate_by_tier: Mapping[str, float] = field(default_factory=dict)
    acquires: int = 0
    acquire_blocks: int = 0
    acquire_hits: Mapping[str, int] = field(default_factory=dict)
    acquire_hit_rate: float = 0.0
    acquire_hit_rate_by_tier: Mapping[str, float] = field(default_factory=dict)
    evictions: Mapping[str, int] = field(default_factory=dict)
    promoted_bytes: int = 0
    read_through_bytes: int = 0  # read from disk into a lease's own buffer, not promoted
    demoted_bytes: int = 0
    quarantined: int = 0
    quarantine_failed: int = 0
    wait_timeouts: int = 0
    unflushed_at_close: int = 0
    token_mismatch: int = 0
    puts: int = 0
    blocks_stored: int = 0
    lookups_per_s: float = 0.0
    mean_lookup_ms: float = 0.0
    # Eviction policy (tierkv/policy.py), per tier: evictions by reason (priority class, or
    # the policy segment of a normal block), hits in the ghost lists, new blocks the policy
    # put in its cold segment, and blocks a put could place in no tier at all.
    eviction_policy: str = ""
    evicted_by: Mapping[str, Mapping[str, int]] = field(default_factory=dict)
    ghost_hits: Mapping[str, int] = field(default_factory=dict)
    cold_admissions: Mapping[str, int] = field(default_factory=dict)
    admissions_refused: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {f: (dict(v) if isinstance(v := getattr(self, f), Mapping) else v) for f in _COUNTER_FIELDS}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "CounterStats":
        return cls(**{f: (dict(d[f]) if isinstance(d[f], Mapping) else d[f]) for f in _COUNTER_FIELDS if f in d})


_COUNTER_FIELDS = tuple(CounterStats.__dataclass_fields__)
# Top-level keys of the JSON shape that are StoreStats fields (the rest are the counters,
# flattened, and ``extra``).
_STATS_FIELDS = ("home", "layout", "blocks", "leased_blocks", "disk_read_path", "model_versions", "namespaces",
                 "index_resizes", "stale_readers_cleared")
# The daemon's page size when a client names none: a reply stays bounded however many
# namespaces exist (3,000 made stats fail for everyone, issue 11, item 9).
DEFAULT_STATS_NAMESPACES = 1000


def namespace_page(namespaces: Mapping[str, int], limit: int | None = None,
                   after: str | None = None) -> tuple[dict[str, int], str | None]:
    """The namespaces sorted by name, at most ``limit`` of those after ``after``, and the
    cursor of the next page (the last name returned; None when nothing remains)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"namespace_limit must be a positive int or None, not {limit!r}")
    names = sorted(ns for ns in namespaces if after is None or ns > after)
    page = names if limit is None else names[:limit]
    more = limit is not None and len(names) > limit
    return {ns: namespaces[ns] for ns in page}, (page[-1] if more else None)


def stats_all_namespaces(store: "StoreAPI") -> "StoreStats":
    """``store.stats()`` with every namespace: the pages fetched and joined (a daemon
    client gets at most a page per reply)."""
    s = store.stats()
    namespaces = dict(s.namespaces)
    # A daemon's per-layout figures carry each page's namespaces: join those too.
    layouts = {lid: {**ls, "namespaces": dict(ls.get("namespaces") or {})}
               for lid, ls in (s.extra.get("layouts") or {}).items()}
    while s.namespaces_next is not None:
        s = store.stats(namespace_after=s.namespaces_next)
        namespaces.update(s.namespaces)
        for lid, ls in (s.extra.get("layouts") or {}).items():
            layouts.setdefault(lid, {**ls, "namespaces": {}})["namespaces"].update(ls.get("namespaces") or {})
    extra = {**s.extra, "layouts": layouts} if "layouts" in s.extra else s.extra
    return replace(s, namespaces=namespaces, namespaces_next=None, extra=extra)
_SECTIONS = ("cluster", "remote", "daemon")


@dataclass(frozen=True)
class StoreStats(Mapping[str, Any]):
    """``stats()`` of any :class:`~tierkv.api.StoreAPI`: occupancy per tier, what is stored
    (blocks per model version and namespace) and the traffic counters.

    Read it by attribute (``s.tiers["disk"].used_bytes``, ``s.counters.hit_rate``). The JSON
    shape (``as_dict``/``to_json``, what ``tierkv stats --json`` prints and the daemon sends)
    is flat: the counters at the top level, the tiers under ``tiers``, a cluster node's
    remote tier under ``tiers.remote``. The object also reads as that (read-only) mapping,
    so ``s["tiers"]["disk"]["blocks"]`` works; it cannot be patched: build a new one with
    :func:`dataclasses.replace`.
    """

    home: str
    layout: Mapping[str, Any]
    blocks: int
    leased_blocks: int
    tiers: Mapping[str, TierStats]
    disk_read_path: str
    model_versions: Mapping[str, int]
    namespaces: Mapping[str, int]
    counters: CounterStats
    index_resizes: int = 0
    stale_readers_cleared: int = 0
    remote_tier: Mapping[str, Any] | None = None  # a cluster node's remote tier (``tiers.remote``)
    cluster: Mapping[str, Any] | None = None  # a cluster node's pull/publish counters
    remote: Mapping[str, Any] | None = None  # the remote tier's own figures
    daemon: Mapping[str, Any] | None = None  # the serving daemon's figures (leases, staging)
    extra: Mapping[str, Any] = field(default_factory=dict)  # keys this version does not know (a newer daemon's)
    namespaces_next: str | None = None  # ``namespaces`` is a page: pass this as namespace_after for the next

    def as_dict(self) -> dict[str, Any]:
        """The JSON shape (stable: tests, docs/cli.md and the daemon rely on it)."""
        out: dict[str, Any] = dict(self.extra)
        out.update({f: getattr(self, f) for f in _STATS_FIELDS})
        for f in ("layout", "model_versions", "namespaces"):
            out[f] = dict(out[f])
        tiers: dict[str, Any] = {name: t.as_dict() for name, t in self.tiers.items()}
        if self.remote_tier is not None:
            tiers["remote"] = dict(self.remote_tier)
        out["tiers"] = tiers
        out.update(self.counters.as_dict())
        if self.cluster is not None:  # a cluster node: "remote" is null when it has no remote tier
            out["cluster"] = dict(self.cluster)
            out["remote"] = None if self.remote is None else dict(self.remote)
        if self.daemon is not None:
            out["daemon"] = dict(self.daemon)
        if self.namespaces_next is not None:  # only a page that is not the last says so
            out["namespaces_next"] = self.namespaces_next
        return out

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StoreStats":
        """Rebuild from the JSON shape (the daemon client does this with the wire's)."""
        tiers_in = dict(d.get("tiers") or {})
        remote_tier = tiers_in.pop("remote", None)
        known = set(_STATS_FIELDS) | set(_COUNTER_FIELDS) | set(_SECTIONS) | {"tiers", "namespaces_next"}
        return cls(
            home=str(d.get("home", "")), layout=dict(d.get("layout") or {}), blocks=int(d.get("blocks", 0)),
            leased_blocks=int(d.get("leased_blocks", 0)),
            tiers={name: TierStats.from_dict(t) for name, t in tiers_in.items()},
            disk_read_path=str(d.get("disk_read_path", "")), model_versions=dict(d.get("model_versions") or {}),
            namespaces=dict(d.get("namespaces") or {}), counters=CounterStats.from_dict(d),
            index_resizes=int(d.get("index_resizes", 0)), stale_readers_cleared=int(d.get("stale_readers_cleared", 0)),
            remote_tier=remote_tier, cluster=d.get("cluster"), remote=d.get("remote"), daemon=d.get("daemon"),
            extra={k: v for k, v in d.items() if k not in known},
            namespaces_next=None if d.get("namespaces_next") is None else str(d["namespaces_next"]),
        )

    # ---- the read-only mapping view of the JSON shape ----------------------------------------
    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(self.as_dict())


@dataclass(eq=False)
class Lease:
    """Blocks held in the device tier for the caller: never evicted, moved or overwritten
    until released. Use as a context manager, or call ``release()`` in ``finally``.

    A lease of ``acquire(..., promote=False)`` may instead hold its pages in a buffer of its
    own (``pool`` is then that buffer, ``slots`` its rows; :mod:`tierkv.read_through`):
    the blocks are leased all the same, and the buffer goes back to the store on release."""

    store: "StoreAPI"  # the store (or client) that issued it: release() goes back there
    layout: PageLayout
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]  # device-tier slot of each block, in prefix order
    pool: torch.Tensor = field(repr=False)  # the device pool the slots index
    blocks: list["Block"] = field(default_factory=list, repr=False)
    released: bool = False
    start_block: int = 0  # the chain position of the first leased block
    read_through: Any = field(default=None, repr=False)  # the buffer of a read-through lease (returned on release)

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    @property
    def tokens_matched(self) -> int:
        """Tokens of the prefix up to the lease's last block (all cached and verified)."""
        return (self.start_block + len(self.slots)) * self.layout.block_size if self.slots else 0

    def _check(self) -> None:
        if self.released:
            from .errors import LeaseError

            raise LeaseError("lease used after release")

    def __repr__(self) -> str:
        # Bounded, whatever the lease's size: counts and the first slot, never the keys (32
        # bytes each), the pool or the store (issue #37, item 10: a lease printed its pool).
        lo = self.layout
        first = f", slots={self.slots[0]}..{self.slots[-1]}" if self.slots else ""
        return (f"{type(self).__name__}(blocks={len(self.slots)}, start_block={self.start_block}{first}, "
                f"layout={lo.dtype}-l{lo.num_layers}-h{lo.num_kv_heads}-d{lo.head_dim}-b{lo.block_size}, "
                f"released={self.released}{self._repr_extra()})")

    def _repr_extra(self) -> str:
        return ""

    def page(self, i: int) -> torch.Tensor:
        """A view of block ``i``'s page in the device pool (valid until release)."""
        self._check()
        return self.pool[self.slots[i]]

    def pages(self) -> torch.Tensor:
        """A copy of all leased pages, ``[n, L, 2, B, H, D]``.

        On the CPU, page by page with numpy into a numpy-allocated buffer: on a 2-core VM
        torch's ``index_select`` over the shared-memory pool ran at 0.27 GB/s, and a fresh
        ``torch.empty`` paid a 4 KiB page fault per page of output, together 6x slower than
        memcpy (scripts/bench_daemon.py)."""
        self._check()
        if not self.slots:
            return torch.empty((0, *self.layout.shape), dtype=self.layout.torch_dtype, device=self.pool.device)
        if self.pool.device.type != "cpu":
            idx = torch.tensor(self.slots, dtype=torch.long, device=self.pool.device)
            return self.pool.index_select(0, idx)
        n, nbytes = len(self.slots), self.layout.page_bytes
        dst = np.empty((n, nbytes), dtype=np.uint8)
        for i, slot in enumerate(self.slots):
            np.copyto(dst[i], self.pool[slot].reshape(-1).view(torch.uint8).numpy())
        return torch.from_numpy(dst).view(self.layout.torch_dtype).view(n, *self.layout.shape)

    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (K, V) in transformers' layout ``[1, H, n*B, D]``, copied into one
        buffer the caller owns (valid after release)."""
        kv = kv_buffer(self.layout, len(self.slots), self.pool.device)
        self.kv_into(kv, 0)
        return split_layers(kv)

    def kv_into(self, kv: torch.Tensor | Sequence[tuple[torch.Tensor, torch.Tensor]], first_block: int,
                layers: tuple[int, int] | None = None) -> None:
        """Copy the leased pages into blocks ``first_block ..`` of a
        :func:`~tierkv.layout.kv_buffer` or :func:`~tierkv.layout.kv_layers` (only layers ``[layers[0], layers[1])`` when given:
        two threads can copy a window in halves). Each run of consecutive slots (the usual
        case: one promotion allocates a run) is read as a view of the pool: one copy per byte."""
        self._check()
        i, n = 0, len(self.slots)
        while i < n:
            j = i + 1
            while j < n and self.slots[j] == self.slots[j - 1] + 1:
                j += 1
            unpack_into(kv, self.pool[self.slots[i] : self.slots[i] + (j - i)], first_block + i, self.layout, layers)
            i = j

    def release(self) -> None:
        if not self.released:
            self.store.release(self)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
