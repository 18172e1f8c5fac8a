"""An in-memory stand-in for tierkv.store.Store, used only while the real store is not
importable. It follows the documented contract (lookup / acquire / put / manifests)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tierkv.errors import NotFoundError
from tierkv.identity import block_keys
from tierkv.layout import PageLayout, unpack_pages


@dataclass(frozen=True)
class FakeLookup:
    tokens_matched: int
    keys: tuple[bytes, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class FakePut:
    stored: int
    skipped: int


class FakeLease:
    def __init__(self, store: "FakeStore", keys: tuple[bytes, ...]) -> None:
        self.store, self.keys = store, keys
        self.num_blocks = len(keys)
        self.tokens_matched = len(keys) * store.layout.block_size

    def pages(self) -> torch.Tensor:
        if not self.keys:
            return torch.empty((0, *self.store.layout.shape), dtype=self.store.layout.torch_dtype)
        return torch.stack([self.store.pages[k] for k in self.keys])

    def kv(self):
        return unpack_pages(self.pages(), self.store.layout)

    def __enter__(self) -> "FakeLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.store.leases -= 1


_HOMES: dict[str, dict] = {}


class FakeStore:
    def __init__(self, home: Path, layout: PageLayout) -> None:
        state = _HOMES.setdefault(str(home), {"pages": {}, "manifests": {}, "priority": {}})
        self.layout, self.pages, self.manifests, self.priority = layout, state["pages"], state["manifests"], state["priority"]
        self.leases = 0

    def lookup(self, tokens, scope) -> FakeLookup:
        keys = []
        for k in block_keys(list(tokens), scope, self.layout.block_size):
            if k not in self.pages:
                break
            keys.append(k)
        return FakeLookup(len(keys) * self.layout.block_size, tuple(keys))

    def acquire(self, tokens, scope, max_blocks=None) -> FakeLease:
        keys = self.lookup(tokens, scope).keys
        self.leases += 1
        return FakeLease(self, keys[:max_blocks] if max_blocks is not None else keys)

    def put(self, tokens, pages, scope, *, start_block=0, priority=None) -> FakePut:
        self.layout.check_pages(pages)
        keys = block_keys(list(tokens), scope, self.layout.block_size)
        stored = 0
        for i in range(pages.shape[0]):
            k = keys[start_block + i]
            if k not in self.pages:
                self.pages[k] = pages[i].detach().cpu().clone()
                self.priority[k] = priority
                stored += 1
        return FakePut(stored, pages.shape[0] - stored)

    def set_priority(self, tokens, scope, priority) -> None:
        for k in self.lookup(tokens, scope).keys:
            self.priority[k] = priority

    def save_manifest(self, name: str, manifest: dict) -> None:
        self.manifests[name] = dict(manifest)

    def get_manifest(self, name: str) -> dict:
        if name not in self.manifests:
            raise NotFoundError(f"no manifest named {name!r}")
        return dict(self.manifests[name])

    def list_manifests(self) -> dict[str, dict]:
        return dict(self.manifests)

    def check_integrity(self) -> None:
        assert self.leases == 0

    def close(self) -> None:
        pass
