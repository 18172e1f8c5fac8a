"""What a client sees of the daemon's pools: shared-memory regions viewed as page pools,
the CUDA IPC pool (untested), and :class:`RemoteLease`, a lease whose pages are read in
place from the daemon's device tier.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import LeaseError
from ..layout import PageLayout
from ..results import Lease
from ..tiers.shm import SharedRegion


@dataclass(eq=False)
class RemoteLease(Lease):
    """A lease held by the daemon for this client; same attributes as :class:`Lease`.
    It ends at :meth:`release`, when the client disconnects, or after the daemon's lease
    timeout without :meth:`renew`; using it after that raises LeaseError."""

    lease_id: int = 0
    timeout_s: float = 600.0
    renewed_at: float = field(default_factory=time.monotonic)

    def _check(self) -> None:
        super()._check()
        if time.monotonic() - self.renewed_at > self.timeout_s:
            raise LeaseError(f"lease {self.lease_id} expired ({self.timeout_s:g} s without renew); its pages may "
                             "have been reused", hint="call lease.renew() while holding a lease for long")

    def renew(self) -> None:
        self._check()
        self.store.renew(self)  # type: ignore[attr-defined]

    def pages(self) -> torch.Tensor:
        """A copy of all leased pages, ``[n, L, 2, B, H, D]``, read from shared memory.

        Page by page with numpy into a numpy-allocated buffer: on a 2-core VM torch's
        ``index_select`` over the shm pool ran at 0.27 GB/s, and a fresh ``torch.empty``
        paid a 4 KiB page fault per page of output (numpy asks for huge pages), together
        6x slower than memcpy (scripts/bench_daemon.py)."""
        self._check()
        if self.pool.device.type != "cpu" or not self.slots:
            return super().pages()
        n, nbytes = len(self.slots), self.layout.page_bytes
        dst = np.empty((n, nbytes), dtype=np.uint8)
        for i, slot in enumerate(self.slots):
            np.copyto(dst[i], self.pool[slot].reshape(-1).view(torch.uint8).numpy())
        return torch.from_numpy(dst).view(self.layout.torch_dtype).view(n, *self.layout.shape)


def pool_view(region: SharedRegion, layout: PageLayout, slots: int, stride_bytes: int) -> torch.Tensor:
    """The region seen as ``[slots, *layout.shape]`` with the daemon's slot stride."""
    assert region.bytes is not None
    if not slots:
        return torch.empty((0, *layout.shape), dtype=layout.torch_dtype)
    inner = torch.empty(layout.shape).stride()
    flat = region.bytes.view(layout.torch_dtype)
    return flat.as_strided((slots, *layout.shape), (stride_bytes // layout.torch_dtype.itemsize, *inner))


def cuda_pool(info: dict[str, Any], layout: PageLayout) -> torch.Tensor:
    """Open the daemon's CUDA device pool from its IPC handle. UNTESTED (needs a GPU)."""
    parts = [bytes.fromhex(p["b"]) if isinstance(p, dict) else p for p in info["storage"]]
    storage = torch.UntypedStorage._new_shared_cuda(*parts)
    t = torch.empty(0, dtype=layout.torch_dtype, device=f"cuda:{int(parts[0])}")
    t.set_(storage)  # 1-D over the whole storage, in the layout's dtype
    slots = int(info["slots"])
    return t[: slots * layout.numel].view(slots, *layout.shape)
