"""Memory tiers: the device pool and the host pool, each one tensor of page slots.

``pool`` has shape ``[slots, num_layers, 2, block_size, num_kv_heads, head_dim]`` so that
attention kernels can read ``pool[slot, layer, 0|1]`` in place. On CUDA the device pool is
one contiguous CUDA tensor. Everything else lives in a :class:`SharedRegion` with slots
padded to 4 KiB (for O_DIRECT reads straight into a slot, and so that a client process can
map the same bytes); the host pool is page-locked when CUDA is present.

With a page codec other than ``none`` (tierkv/codec.py) the host pool holds pages in the
codec's stored form (``[slots, stored_bytes]`` uint8, slots padded to 4 KiB) and the device
pool decodes what is written into it: ``write`` takes a page in either form, ``page`` gives
the slot as the tier holds it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..checksum import page_rows
from ..codec import PageCodec
from ..layout import PageLayout
from .base import SlotAllocator, TierName
from .shm import SharedRegion

# How far beyond its highest slot in use a shared-memory tier has its pages faulted in, on
# the region's helper thread (without StoreConfig.populate_memory, which faults in the whole
# tier). A first touch of fresh shared memory costs ~1.2 ms per MiB on a 2-vCPU VM, against
# ~0.4 ms for MADV_POPULATE_WRITE on a range: a put or read into fresh slots ran at half the
# disk's speed with the faults in its path (issue #31; docs/performance.md). Faulting ahead
# of use moves them to the other core and never more than this much before it is needed, so
# an engine that opens its store and serves at once shares no core with a populator of its
# whole pool.
POPULATE_AHEAD_BYTES = 64 << 20


def _consecutive(ids: list[int]) -> bool:
    """Whether ``ids`` (not empty) are ``ids[0], ids[0] + 1, ...``."""
    return ids[-1] - ids[0] == len(ids) - 1 and (len(ids) < 3 or ids == list(range(ids[0], ids[-1] + 1)))


def cpu_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy one CPU page into another through numpy. torch's intra-op thread pool makes
    small copies slow on few-core machines (measured here on 2 cores: 15 ms for 1 MiB
    with torch.copy_ against 0.05 ms with numpy)."""
    if dst.is_contiguous() and src.is_contiguous() and dst.dtype == src.dtype and dst.shape == src.shape:
        np.copyto(dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy())
    else:
        dst.copy_(src)


class MemoryTier:
    def __init__(
        self, name: TierName, layout: PageLayout, capacity_bytes: int, device: str, shm_dir: Path, pin: bool = False,
        codec: PageCodec | None = None, limit_bytes: int | None = None, populate: bool = False,
        ahead_at_open: bool = False,
    ) -> None:
        """``capacity_bytes`` of slots; ``limit_bytes`` (default: all) is what may be used
        now (:meth:`set_limit`): in shared memory the slots above it stay sparse. ``populate``:
        fault the usable slots in on a background thread (StoreConfig.populate_memory);
        ``ahead_at_open``: only the first POPULATE_AHEAD_BYTES (:meth:`fault_in_first`)."""
        self.name = name
        self.populate = populate
        self.layout = layout
        self.device = torch.device(device)
        self.region: SharedRegion | None = None
        self.codec = codec or PageCodec("none", layout)
        # The host pool keeps the stored form; the device pool always the layout's exact one.
        self.encoded = name == TierName.HOST and not self.codec.exact
        if self.encoded:
            self.stride_bytes = self.codec.slot_bytes
            slots = capacity_bytes // self.stride_bytes
            self.region = self._map_region(shm_dir, slots, pin)
            assert self.region.bytes is not None
            self._pool = self.region.bytes.view(slots, self.stride_bytes)[:, : self.codec.stored_bytes] if slots \
                else torch.empty((0, self.codec.stored_bytes), dtype=torch.uint8)
        elif self.device.type == "cuda":
            self.stride_bytes = layout.page_bytes
            slots = capacity_bytes // self.stride_bytes
            self._pool = torch.empty((slots, *layout.shape), dtype=layout.torch_dtype, device=self.device)
        else:
            # The host pool pads slots to 4 KiB so O_DIRECT can read straight into one; the
            # CPU stand-in for the device pool is packed like the CUDA one.
            self.stride_bytes = layout.slot_bytes if name == TierName.HOST else layout.page_bytes
            slots = capacity_bytes // self.stride_bytes
            self.region = self._map_region(shm_dir, slots, pin)
            self._pool = self._view_pool(self.region, layout, slots)
        self._ahead_end = 0  # without populate: bytes asked to be faulted in ahead of use
        ahead = self._grew if self.region is not None and not populate else None
        self.slots = SlotAllocator(slots, on_release_above=self._discard, on_new_high=ahead)
        if limit_bytes is not None:
            self.set_limit(limit_bytes)
        self._bytes_view: np.ndarray | None = None  # the CPU pool as bytes, made on first write_many
        if ahead_at_open:
            self.fault_in_first()

    def _map_region(self, shm_dir: Path, slots: int, pin: bool) -> SharedRegion:
        """The shared-memory region of ``slots`` slots at this tier's stride, populated in the
        background only when the tier is (``populate``), page-locked with ``pin``."""
        region = SharedRegion.create(shm_dir, f"tierkv-{self.name.value}", slots * self.stride_bytes,
                                     populate_bytes=None if self.populate else 0)
        if pin:
            region.pin()
        return region

    def _view_pool(self, region: SharedRegion, layout: PageLayout, slots: int) -> torch.Tensor:
        """The region's bytes seen as ``[slots, *layout.shape]`` with this tier's slot stride."""
        assert region.bytes is not None
        itemsize = layout.torch_dtype.itemsize
        flat = region.bytes.view(layout.torch_dtype) if slots else torch.empty(0, dtype=layout.torch_dtype)
        inner = torch.empty(layout.shape).stride()
        return flat.as_strided((slots, *layout.shape), (self.stride_bytes // itemsize, *inner))

    @property
    def pool(self) -> torch.Tensor:
        return self._pool

    @property
    def page_bytes(self) -> int:
        """Bytes of one page as this tier holds it."""
        return self.codec.stored_bytes if self.encoded else self.layout.page_bytes

    @property
    def capacity_bytes(self) -> int:
        """What the tier may hold now: its limit (the mapping may be larger, ``describe``)."""
        return self.slots.limit * self.page_bytes

    def set_limit(self, limit_bytes: int) -> None:
        """Use at most ``limit_bytes`` of slots from now on (at most the capacity; counted as
        ``capacity_bytes`` was given). The free slots above the limit give their memory back
        now, the used ones when freed (the store evicts them). Raising it faults slots in."""
        limit = min(self.slots.capacity, max(0, limit_bytes) // self.stride_bytes)
        self.slots.set_limit(limit)
        if self.region is None:
            return  # a CUDA pool is allocated whole: a limit bounds its use, not its memory
        self.region.set_populate_end(limit * self.stride_bytes if self.populate
                                     else min(self._ahead_end, limit * self.stride_bytes))
        start = limit
        for slot in [*self.slots.used_above_limit(), self.slots.capacity]:  # free runs between used slots
            if slot > start:
                self.region.discard(start * self.stride_bytes, (slot - start) * self.stride_bytes)
            start = slot + 1

    def fault_in_first(self) -> None:
        """Have the region fault its first POPULATE_AHEAD_BYTES in now, in the background
        (held: the store lock, or the store is not shared yet): what :meth:`_grew` asks
        for before any slot is in use. The first promotion into a fresh tier then reads into
        pages already faulted in, with no populator of the next 64 MiB beside it
        (StoreConfig.populate_device_ahead)."""
        if self.region is not None and not self.populate and self.slots.limit > 0:
            self._grew(-1)

    def _grew(self, slot: int) -> None:
        """The tier's use reached ``slot`` (held: the store lock): have the region fault
        pages in up to POPULATE_AHEAD_BYTES beyond it, asked again once half of that is used
        (so a growing tier asks every 32 MiB; a put of up to 32 MiB finds its slots faulted
        in while the put before it ran)."""
        assert self.region is not None
        used_end = (slot + 1) * self.stride_bytes
        if used_end + POPULATE_AHEAD_BYTES // 2 <= self._ahead_end:
            return
        self._ahead_end = used_end + POPULATE_AHEAD_BYTES
        self.region.set_populate_end(min(self._ahead_end, self.slots.limit * self.stride_bytes))

    def reserve(self, n: int) -> list[int]:
        """``n`` free slots of a CPU pool, now used (the caller places or frees each), when
        that many are free without evicting anything; else none (an empty list). Never on
        CUDA, nor in a pool that holds another form than the layout's."""
        if self.region is None or self.encoded or self.slots.num_free < n:
            return []
        taken: list[int] = []
        for _ in range(n):
            slot = self.slots.alloc()
            if slot is None:  # the tier's limit
                for s in taken:
                    self.slots.free(s)
                return []
            taken.append(slot)
        return taken

    def _discard(self, slot: int) -> None:
        """A slot above the limit was freed: give its memory back."""
        if self.region is not None:
            self.region.discard(slot * self.stride_bytes, self.stride_bytes)

    @property
    def used_bytes(self) -> int:
        return self.slots.num_used * self.page_bytes

    @property
    def pinned(self) -> bool:
        return bool(self.region and self.region.pinned)

    def page(self, slot: int) -> torch.Tensor:
        """A view of the page in ``slot`` (valid while the caller holds the block), in the
        form this tier holds it (the codec's stored form in an encoded host pool)."""
        return self._pool[slot]

    def direct_target(self, slot: int) -> memoryview | None:
        """The page bytes of ``slot`` when a disk read may land in them directly
        (shared memory, 4 KiB-aligned start and length), else None."""
        if self.region is None or self.region.bytes is None or not self.codec.exact:
            return None  # with a codec, disk bytes are the stored form: decoded on the way in
        start, n = slot * self.stride_bytes, self.layout.page_bytes
        if start % 4096 or n % 4096:
            return None
        return memoryview(self.region._mmap)[start : start + n]

    def write(self, slot: int, page: torch.Tensor, non_blocking: bool = False) -> None:
        """Copy ``page`` (in the layout's form or the codec's stored form) into ``slot``,
        encoding or decoding it to this tier's form. ``non_blocking``: a copy between
        page-locked host memory and CUDA may still run when this returns; the caller waits
        for the device before the slot or the source is used."""
        dst = self._pool[slot]
        if not self.encoded and not self.codec.is_layout_form(page) and dst.is_contiguous() and dst.device == page.device:
            self.codec.decode_into(page, dst)  # straight into the slot: no buffer in between
            return
        page = self.codec.to_stored(page) if self.encoded else self.codec.to_layout(page)
        if dst.is_cuda or page.is_cuda:
            # Asynchronous only when the caller waits for it: a copy from CUDA into the page-
            # locked host pool that returns early could let the slot be read (a demotion to
            # disk, a client's mapping) or its CUDA source be reused (by kvikio, which no
            # stream orders) before the bytes arrive.
            dst.copy_(page, non_blocking=non_blocking)
        else:
            cpu_copy(dst, page)

    def write_many(self, slots: list[int], pages: torch.Tensor, rows: list[int],
                   data: np.ndarray | None = None) -> None:
        """``write(slots[j], pages[rows[j]])`` for every j, as one copy where the pool and
        the pages are CPU memory (a put of many small pages spent its time in per-page calls).
        ``data``: ``page_rows(pages)`` when the caller has it (a put, from its checksums)."""
        if not slots:
            return
        if data is not None and not self.encoded and self.codec.exact and self._bytes_view is not None:
            # The put's common case, without the checks below: exact pages, CPU pool (only
            # a CPU pool has a bytes view), and the caller's bytes of them.
            self._copy_rows(slots, data, rows)
            return
        if self.encoded:
            # Encode only the rows written (a put's pages also go to the device exact).
            idx = torch.as_tensor(rows, device=pages.device)
            stored = pages.index_select(0, idx) if not self.codec.is_stored_form(pages) else pages[idx]
            pages, rows = self.codec.to_stored(stored.cpu()), list(range(len(rows)))
        else:
            pages = self.codec.to_layout(pages)
        if self._pool.is_cuda or pages.is_cuda or pages.dtype != self._pool.dtype or not pages.is_contiguous():
            for s, r in zip(slots, rows):
                self.write(s, pages[r])
            return
        if self._bytes_view is None:
            self._bytes_view = self._pool.view(torch.uint8).numpy()  # the pool's strides (host slots are padded)
        self._copy_rows(slots, page_rows(pages), rows)

    def _copy_rows(self, slots: list[int], data: np.ndarray, rows: list[int]) -> None:
        """Rows ``rows`` of ``data`` (pages as bytes, ``[n, page bytes]``) into ``slots`` of
        the CPU pool, in one numpy assignment."""
        assert self._bytes_view is not None
        src = data.reshape(-1, *self._bytes_view.shape[1:])  # contiguous: a view
        # A put's rows are consecutive, and so are the slots of a tier that is filling up:
        # slices, not gathers (a slice assignment is one memcpy).
        values = src[rows[0] : rows[-1] + 1] if _consecutive(rows) else src[np.asarray(rows)]
        if _consecutive(slots):
            self._bytes_view[slots[0] : slots[-1] + 1] = values
        else:
            self._bytes_view[np.asarray(slots)] = values

    def describe(self) -> dict[str, object]:
        return {
            "kind": "cuda" if self.device.type == "cuda" else ("pinned-shm" if self.pinned else "shm"),
            "shm_path": str(self.region.path) if self.region else None,
            "stride_bytes": self.stride_bytes,
            "page_codec": self.codec.name if self.encoded else "none",
            "slots": self.slots.capacity,
            "limit_slots": self.slots.limit,
        }

    def check_integrity(self) -> None:
        self.slots.check_integrity()
        assert self._pool.shape[0] == self.slots.capacity

    def close(self) -> None:
        self._pool = torch.empty(0)
        if self.region is not None:
            self.region.close()
