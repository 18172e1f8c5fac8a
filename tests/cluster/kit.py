"""Helpers for the cluster tests: a tiny layout, deterministic tokens and pages, and an
in-memory stand-in for a Mooncake cluster (one dict shared by every node's client) whose
faults the tests switch on and off."""
from __future__ import annotations

import hashlib
import random
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

import tierkv
from tierkv import PageLayout, Scope
from tierkv.cluster import ClusterNode, PublishPolicy
from tierkv.identity import block_keys
from tierkv.cluster.remote import RemoteConfig, RemoteTier

LAYOUT = PageLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
BS = LAYOUT.block_size
PAGE, SLOT = LAYOUT.page_bytes, LAYOUT.slot_bytes
MV1 = hashlib.sha256(b"tiny-model v1").hexdigest()
MV2 = hashlib.sha256(b"tiny-model v2").hexdigest()
SCOPE = Scope(MV1)
RPC_FAIL = -900  # what Mooncake answers per key while its master is unreachable
STORE_OPTIONS: dict[str, Any] = dict(device="cpu", device_bytes=16 * PAGE, host_bytes=8 * SLOT,
                                     disk_bytes=64 * SLOT, segment_pages=8)


def toks(seed: int, n_blocks: int, extra: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 50_000) for _ in range(n_blocks * BS + extra)]


def pages_for(tokens: Sequence[int], scope: Scope = SCOPE) -> torch.Tensor:
    out = []
    for k in block_keys(tokens, scope, BS):
        g = torch.Generator().manual_seed(int.from_bytes(k[:8], "little") & (2**63 - 1))
        out.append(torch.randn(LAYOUT.shape, generator=g))
    return torch.stack(out)


class FakeCluster:
    """The remote store every fake client shares. ``down`` makes calls fail the way a
    dead master does (negative status); ``hang_s`` makes them slow; ``refuse_setup``
    makes new clients fail setup; ``restart()`` loses every object."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = False
        self.hang_s = 0.0
        self.refuse_setup = False
        self.setups = 0
        self.lock = threading.Lock()

    def restart(self) -> None:
        with self.lock:
            self.objects.clear()

    def factory(self, config: RemoteConfig) -> "FakeClient":
        if self.refuse_setup or self.down:
            raise OSError("mooncake setup returned -900")
        self.setups += 1
        return FakeClient(self)


class FakeClient:
    def __init__(self, cluster: FakeCluster) -> None:
        self.c = cluster

    def _wait(self) -> None:
        if self.c.hang_s:
            time.sleep(self.c.hang_s)

    def put_batch(self, keys: list[str], values: list[bytes]) -> int:
        self._wait()
        if self.c.down:
            return RPC_FAIL
        with self.c.lock:
            for k, v in zip(keys, values, strict=True):
                self.c.objects.setdefault(k, bytes(v))
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self._wait()
        if self.c.down:
            return [RPC_FAIL] * len(keys)
        return [int(k in self.c.objects) for k in keys]

    def get_batch(self, keys: list[str]) -> list[bytes]:
        self._wait()
        if self.c.down:
            return [b""] * len(keys)
        return [self.c.objects.get(k, b"") for k in keys]

    def remove(self, key: str) -> int:
        with self.c.lock:
            self.c.objects.pop(key, None)
        return 0

    def close(self) -> int:
        return 0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def remote_config(**kw: Any) -> RemoteConfig:
    base: dict[str, Any] = dict(master_address="127.0.0.1:1", metadata_url="http://127.0.0.1:2/metadata",
                                op_timeout_s=1.0, setup_timeout_s=1.0)
    base.update(kw)
    return RemoteConfig(**base)


def make_node(home: Path, cluster: FakeCluster, clock: Clock | None = None, policy: PublishPolicy | None = None,
              **remote_kw: Any) -> ClusterNode:
    store = tierkv.open(home, LAYOUT, shm_dir=home.parent / f"shm-{home.name}", **STORE_OPTIONS)
    remote = RemoteTier(remote_config(**remote_kw), LAYOUT, backend_factory=cluster.factory,
                        clock=clock or time.monotonic)
    return ClusterNode(store, remote, policy)
