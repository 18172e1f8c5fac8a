"""A lease: blocks held in the device tier for the caller (what ``acquire`` returns).

Its own module, beside the plain results (results.py), because a lease is a handle that owns
something: the blocks stay put until :meth:`Lease.release`, and the holder elsewhere (a
daemon, for its client) may end it unless renewed (:class:`LeaseHold`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from .layout import PageLayout, kv_buffer, split_layers, unpack_into

if TYPE_CHECKING:
    from .api import StoreAPI
    from .core.blocks import Block


class LeaseHold(Protocol):
    """What holds a lease elsewhere (a daemon, for its client) and ends it unless renewed."""

    lease_id: int

    def check(self) -> None:
        """Raise LeaseError once the holder has ended the lease (timed out)."""

    def renew(self) -> None:
        """Restart the holder's timeout."""


@dataclass(eq=False)
class Lease:
    """Blocks held in the device tier for the caller: never evicted, moved or overwritten
    until released. Use as a context manager, or call ``release()`` in ``finally``.

    A lease of ``acquire(..., promote=False)`` may instead hold its pages in a buffer of its
    own (``pool`` is then that buffer, ``slots`` its rows; :mod:`tierkv.core.read_through`):
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
    # A lease a daemon holds for this client (daemon/remote_lease.DaemonHold): its id, and the
    # timeout after which the daemon ends it unless renewed. None for an embedded store's.
    hold: "LeaseHold | None" = field(default=None, repr=False)

    @property
    def num_blocks(self) -> int:
        return len(self.slots)

    @property
    def tokens_matched(self) -> int:
        """Tokens of the prefix up to the lease's last block (all cached and verified)."""
        return (self.start_block + len(self.slots)) * self.layout.block_size if self.slots else 0

    @property
    def lease_id(self) -> int:
        """The daemon's id of this lease (0: a miss, or a lease of an embedded store)."""
        return self.hold.lease_id if self.hold is not None else 0

    def renew(self) -> None:
        """Restart a daemon's idle timeout of this lease; an embedded store's lease has none."""
        self._check()
        if self.hold is not None:
            self.hold.renew()

    def _check(self) -> None:
        if self.released:
            from .errors import LeaseError

            raise LeaseError("lease used after release")
        if self.hold is not None:
            self.hold.check()

    def __repr__(self) -> str:
        # Bounded, whatever the lease's size: counts and the first slot, never the keys (32
        # bytes each), the pool or the store (issue #37, item 10: a lease printed its pool).
        lo = self.layout
        first = f", slots={self.slots[0]}..{self.slots[-1]}" if self.slots else ""
        return (f"{type(self).__name__}(blocks={len(self.slots)}, start_block={self.start_block}{first}, "
                f"layout={lo.dtype}-l{lo.num_layers}-h{lo.num_kv_heads}-d{lo.head_dim}-b{lo.block_size}, "
                f"released={self.released}{f', lease_id={self.lease_id}' if self.hold is not None else ''})")

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
