"""Bounce buffers (tierkv/tiers/diskio.py): whole 2 MiB of private memory, advised to use
transparent huge pages before anything touches it, resident at once when asked, and real
O_DIRECT targets."""
from __future__ import annotations

import os

import pytest
import torch

from tierkv.tiers import diskio
from tierkv.tiers.diskio import BounceBuffer, probe_odirect
from tierkv.tiers.madvise import HUGE_PAGE, MADV_HUGEPAGE, MADV_POPULATE_WRITE

from helpers.residency import resident_bytes, vma_fields


def test_huge_page_advice_comes_before_population(monkeypatch):
    calls: list[tuple[int, int, int]] = []
    real = diskio.advise

    def recording(addr: int, n: int, advice: int) -> bool:
        calls.append((addr, n, advice))
        return real(addr, n, advice)

    monkeypatch.setattr(diskio, "advise", recording)
    buf = BounceBuffer(3 << 20)  # not a multiple of 2 MiB: the mapping is rounded up
    try:
        assert len(buf.mm) == 4 << 20 and buf.tensor.numel() == 3 << 20
        assert [c[2] for c in calls] == [MADV_HUGEPAGE, MADV_POPULATE_WRITE]
        assert all(c[0] == buf.tensor.data_ptr() and c[1] == len(buf.mm) for c in calls)
        assert resident_bytes(buf.tensor.data_ptr(), 3 << 20) == 3 << 20  # populated: resident
    finally:
        buf.close()


def test_unpopulated_buffer_is_not_resident_until_used():
    buf = BounceBuffer(8 << 20, populate=False)
    try:
        assert resident_bytes(buf.tensor.data_ptr(), 8 << 20) == 0
        buf.tensor[:] = 7
        assert int(buf.tensor[-1]) == 7 and resident_bytes(buf.tensor.data_ptr(), 8 << 20) == 8 << 20
    finally:
        buf.close()


def test_huge_pages_back_the_buffer_where_the_system_offers_them():
    """Where THP is on (``madvise`` or ``always``) and a 2 MiB-multiple anonymous mapping is
    placed on a 2 MiB boundary, the kernel backs the buffer with huge pages; elsewhere the
    buffer still works on small pages (checked too)."""
    try:
        mode = open("/sys/kernel/mm/transparent_hugepage/enabled").read()
        # Without compaction on demand for advised regions, a fragmented machine may fall
        # back to small pages: asserted only where the kernel compacts for them.
        defrag = open("/sys/kernel/mm/transparent_hugepage/defrag").read()
    except OSError:
        mode, defrag = "[never]", "[never]"
    compacts = any(f"[{d}]" in defrag for d in ("always", "madvise", "defer+madvise"))
    buf = BounceBuffer(16 << 20)
    try:
        buf.tensor[:] = 1
        assert int(buf.tensor.sum()) == 16 << 20
        aligned = buf.tensor.data_ptr() % HUGE_PAGE == 0
        if "[never]" not in mode and compacts and aligned:
            assert vma_fields(buf.tensor.data_ptr()).get("AnonHugePages", 0) > 0, "no huge page in a THP-advised buffer"
    finally:
        buf.close()


def test_an_odirect_read_lands_in_a_bounce_buffer(tmp_path):
    if not probe_odirect(tmp_path):
        pytest.skip("this file system refuses O_DIRECT (tmpfs, some overlays): nothing to read through")
    data = os.urandom(5 << 20)
    path = tmp_path / "f"
    path.write_bytes(data)
    buf = BounceBuffer(len(data))
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        assert os.preadv(fd, [memoryview(buf.mm)[: len(data)]], 0) == len(data)
        assert bytes(buf.tensor.numpy()) == data
        assert torch.equal(buf.tensor[:16], torch.frombuffer(bytearray(data[:16]), dtype=torch.uint8))
    finally:
        os.close(fd)
        buf.close()
