"""What a client sees of the daemon's pools: shared-memory regions viewed as page pools,
the CUDA IPC pool (untested), and :class:`RemoteLease`, a lease whose pages are read in
place from the daemon's device tier.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import LeaseError, ProtocolError
from ..layout import PageLayout
from ..results import Lease
from ..tiers.shm import SharedRegion


@dataclass(eq=False, repr=False)  # Lease's bounded repr, with the lease id
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

    def _repr_extra(self) -> str:
        return f", lease_id={self.lease_id}"

    def renew(self) -> None:
        self._check()
        self.store.renew(self)  # type: ignore[attr-defined]


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


def map_pools(hello: dict[str, Any], fds: list[int],
              layout: PageLayout) -> tuple[list[SharedRegion], torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """A client's view of the daemon's pools from its HELLO reply: (the regions mapped,
    device pool, host pool or None, staging pool). Each region is mapped from the descriptor
    sent with the reply (``fds``; a used one is set to -1), never from a path the daemon
    names: a fake listener could name any file this client may write."""
    regions: list[SharedRegion] = []
    pools = {}
    try:
        for name in ("device", "host", "staging"):
            info = hello.get(name)
            if info:
                k = info.get("fd")
                if not isinstance(k, int) or not 0 <= k < len(fds) or fds[k] < 0:
                    raise ProtocolError(f"the daemon sent no descriptor for its {name} region")
                fd, fds[k] = fds[k], -1
                regions.append(SharedRegion.attach_fd(fd, int(info["nbytes"]), name))
                pools[name] = pool_view(regions[-1], layout, int(info["slots"]), int(info["stride_bytes"]))
        if "device" in pools:
            device = pools["device"]
        elif hello.get("device_ipc"):
            device = cuda_pool(hello["device_ipc"], layout)
        else:
            raise ProtocolError("the daemon shares no device pool this client can map")
    except BaseException:
        for r in regions:
            r.close()
        raise
    return regions, device, pools.get("host"), pools["staging"]
