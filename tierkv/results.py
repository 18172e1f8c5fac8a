"""Typed results of store operations (no bare tuples or -1 sentinels across modules)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from .layout import PageLayout, unpack_pages

if TYPE_CHECKING:
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
class VerifyResult:
    checked: int
    corrupt: tuple[str, ...]  # hex keys whose page failed its checksum or could not be read
    repaired: bool


@dataclass(eq=False)
class Lease:
    """Blocks held in the device tier for the caller: never evicted, moved or overwritten
    until released. Use as a context manager, or call ``release()`` in ``finally``."""

    store: object
    layout: PageLayout
    keys: tuple[bytes, ...]
    slots: tuple[int, ...]  # device-tier slot of each block, in prefix order
    pool: torch.Tensor  # the device pool the slots index
    blocks: list["Block"] = field(default_factory=list, repr=False)
    released: bool = False
    start_block: int = 0  # the chain position of the first leased block

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
        buffer the caller owns (valid after release). Slots that form one run (the usual case:
        one promotion allocates a run) are read as a view of the pool, so one copy suffices."""
        self._check()
        n = len(self.slots)
        if n and self.slots == tuple(range(self.slots[0], self.slots[0] + n)):
            return unpack_pages(self.pool[self.slots[0] : self.slots[0] + n], self.layout)
        return unpack_pages(self.pages(), self.layout)

    def release(self) -> None:
        if not self.released:
            self.store.release(self)  # type: ignore[attr-defined]

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
