"""The implementations of :class:`tierkv.api.StoreAPI` the conformance suite runs against:
the embedded store, a :class:`~tierkv.home.Home` over it (what ``--home`` commands open), a
:class:`~tierkv.home.tenant.TenantView` of that home (one uid under ``namespace_per_uid``), a
client of a daemon serving from a thread of this process, and a
:class:`~tierkv.cluster.ClusterNode` over the in-process fake cluster."""
from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

import tierkv
from helpers.daemons import DaemonThread
from tierkv import PageLayout, Scope
from tierkv.identity import block_keys

KINDS = ("embedded", "home", "tenant", "daemon", "cluster")
LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BS = LAYOUT.block_size
MV_A = hashlib.sha256(b"conformance model a").hexdigest()
MV_B = hashlib.sha256(b"conformance model b").hexdigest()
SCOPE = Scope(MV_A, "tenant-a")
# The same tier sizes for every implementation, so that the same scenario evicts the same way.
SIZES: dict[str, int] = dict(device_bytes=32 * LAYOUT.page_bytes, host_bytes=32 * LAYOUT.slot_bytes,
                             disk_bytes=4096 * LAYOUT.slot_bytes)  # 16 segments of the default 256 pages


def tokens(seed: int, n_blocks: int, extra: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 50_000, n_blocks * BS + extra).astype(np.int32)


def pages_for(toks: np.ndarray, scope: Scope = SCOPE, layout: PageLayout = LAYOUT) -> torch.Tensor:
    """A pure function of each block's key: any implementation must hand back these bytes."""
    out = []
    for k in block_keys(toks, scope, layout.block_size):
        g = torch.Generator().manual_seed(int.from_bytes(k[:8], "little") & (2**63 - 1))
        out.append(torch.randn(layout.shape, generator=g).to(layout.torch_dtype))
    if not out:
        return torch.empty((0, *layout.shape), dtype=layout.torch_dtype)
    return torch.stack(out)


def short_dir(prefix: str) -> Path:
    """A private directory under /tmp: AF_UNIX socket paths are limited to 107 bytes."""
    return Path(tempfile.mkdtemp(dir="/tmp", prefix=prefix))


def run_daemon(workdir: Path, layout: PageLayout | None, **sizes: int) -> DaemonThread:
    """``tierkv serve`` in a thread of the test process, on its own home, serving (the whole
    budget to the one layout, as the embedded store has it). No warm start, as the embedded
    stores here: every implementation opens with empty memory tiers (the daemon's warm start
    is tests/daemon/test_warm_restart.py's)."""
    from tierkv.daemon.config import DaemonConfig, LayoutSettings, ServerSettings, StagingSettings, StoreSettings

    return DaemonThread(DaemonConfig(
        store=StoreSettings(home=workdir / "home", device="cpu", shm_dir=workdir / "shm", warm_at_open=False,
                            **{**SIZES, **sizes}),
        server=ServerSettings(socket=workdir / "d.sock", workers=2),
        staging=StagingSettings(region_bytes=256 * layout_slot(layout), per_client_bytes=64 * layout_slot(layout)),
        layouts=LayoutSettings(preload=layout, max_open=1))).start()


def layout_slot(layout: PageLayout | None) -> int:
    return (layout or LAYOUT).slot_bytes


@dataclass
class Impl:
    """One implementation under test: ``api`` plus how to tear it down."""

    kind: str
    api: Any
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    local: Any = None  # the embedded Store behind ``api`` (tests that damage it on purpose)

    def close(self) -> None:
        try:
            self.api.close()
        finally:
            for fn in reversed(self.cleanup):
                fn()


def open_impl(kind: str, workdir: Path, layout: PageLayout = LAYOUT, **sizes: int) -> Impl:
    if kind == "embedded":
        store = tierkv.open(workdir / "home", layout, device="cpu", shm_dir=workdir / "shm", **{**SIZES, **sizes})
        return Impl(kind, store, local=store)
    if kind == "home":  # a home's stores as one (what --home commands open): here the one layout's
        from tierkv.home import Home

        store = tierkv.open(workdir / "home", layout, device="cpu", shm_dir=workdir / "shm", **{**SIZES, **sizes})
        return Impl(kind, Home(workdir / "home", [store]), local=store)
    if kind == "tenant":  # the home as one uid sees it under namespace_per_uid (every name rewritten)
        import os

        from tierkv.home import Home
        from tierkv.home.tenancy import Tenancy
        from tierkv.home.tenant import TenantView

        store = tierkv.open(workdir / "home", layout, device="cpu", shm_dir=workdir / "shm", **{**SIZES, **sizes})
        return Impl(kind, TenantView(Home(workdir / "home", [store]), Tenancy(per_uid=True), os.getuid()),
                    [store.close], local=store)
    if kind == "daemon":
        runner = run_daemon(workdir, layout, **sizes)
        try:
            client = tierkv.connect(runner.socket)
        except BaseException:
            runner.stop()
            raise
        entry = runner.daemon.layouts.only()
        return Impl(kind, client, [runner.stop], local=entry.local if entry is not None else None)
    if kind == "cluster":
        from cluster.kit import FakeCluster, remote_config

        from tierkv.cluster import ClusterNode
        from tierkv.cluster.remote import RemoteTier

        store = tierkv.open(workdir / "home", layout, device="cpu", shm_dir=workdir / "shm", **{**SIZES, **sizes})
        fake = FakeCluster()
        return Impl(kind, ClusterNode(store, RemoteTier(remote_config(), layout, backend_factory=fake.factory,
                                                        clock=time.monotonic)), local=store)
    raise ValueError(kind)


def remove(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
