"""Shared-memory regions are populated in the background, never at open and never by
writing: bytes written while the populator runs survive it."""
from __future__ import annotations

import time

import pytest
import torch

from tierkv.tiers.shm import SharedRegion


def _rss_kib(path_name: str) -> int:
    """Resident KiB of this process's mapping of the file named ``path_name``."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if not line[0].isupper() or ":" not in line.split()[0]:
                inside = path_name in line
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


def test_region_is_populated_in_the_background_without_touching_its_bytes(tmp_path):
    nbytes = 96 << 20
    region = SharedRegion.create(tmp_path, "tierkv-host", nbytes)
    try:
        assert region.bytes is not None
        # Written while the populator may still be running: must survive it.
        pattern = torch.arange(4096, dtype=torch.uint8)
        for off in (0, 40 << 20, nbytes - 4096):
            region.bytes[off : off + 4096] = pattern
        assert region._populator is not None
        region._populator.join(timeout=30)
        for off in (0, 40 << 20, nbytes - 4096):
            assert torch.equal(region.bytes[off : off + 4096], pattern)
        assert region.bytes[8192 : 8192 + 4096].sum().item() == 0
        rss = _rss_kib(region.path.name)
        if rss == 0:
            pytest.fail("the mapping was not found in /proc/self/smaps")
        assert rss >= nbytes // 1024 * 0.95, f"only {rss} KiB resident after populating {nbytes >> 10} KiB"
    finally:
        region.close()


def test_close_while_populating_stops_the_populator(tmp_path):
    region = SharedRegion.create(tmp_path, "tierkv-host", 512 << 20)
    populator = region._populator
    t0 = time.perf_counter()
    region.close()
    assert populator is not None and not populator.is_alive()
    assert not region.path.exists()
    assert time.perf_counter() - t0 < 5.0


def test_regions_populate_one_chunk_at_a_time(tmp_path, monkeypatch):
    """A store's device and host regions populate at once on threads of their own, but
    never two chunks at the same time (at most one core goes to it), and both complete."""
    import threading

    from tierkv.tiers import shm

    real = shm._madvise()
    if real is None:
        pytest.skip("no madvise in this libc: regions fault in on use, there is no populator")
    state = {"in_flight": 0, "most": 0, "calls": 0}
    guard = threading.Lock()

    def counting(addr, n, advice):
        with guard:
            state["in_flight"] += 1
            state["calls"] += 1
            state["most"] = max(state["most"], state["in_flight"])
        try:
            time.sleep(0.001)  # long enough that two unserialised chunks would overlap
            return real(addr, n, advice)
        finally:
            with guard:
                state["in_flight"] -= 1

    monkeypatch.setattr(shm, "_madvise", lambda: counting)
    regions = [SharedRegion.create(tmp_path, f"tierkv-{name}", 24 << 20) for name in ("device", "host")]
    try:
        for r in regions:
            assert r._populator is not None
            r._populator.join(timeout=30)
            assert _rss_kib(r.path.name) >= (24 << 20) // 1024 * 0.95
        assert state["calls"] >= 2 * (24 << 20) // shm._POPULATE_CHUNK
        assert state["most"] == 1
    finally:
        for r in regions:
            r.close()


@pytest.mark.parametrize("populate", [False, True])
def test_a_store_populates_its_memory_tiers_only_when_asked(tmp_path, populate):
    """``populate_memory`` (the daemon sets it) faults the device and host tiers in behind
    the open; by default nothing does, and the pages fault in on first use: an engine
    that opens its store and serves at once must not share its cores with a populator."""
    import tierkv
    from tierkv import PageLayout, Scope

    layout = PageLayout(num_layers=1, num_kv_heads=1, head_dim=64, block_size=16, dtype="float32")  # 8 KiB pages
    store = tierkv.open(tmp_path / "home", layout, device="cpu", device_bytes=8 << 20, host_bytes=8 << 20,
                        disk_bytes=0, shm_dir=tmp_path, populate_memory=populate)
    try:
        regions = [store.device.region, store.host.region]
        for r in regions:
            assert r is not None and (r._populator is not None) == populate
            if r._populator is not None:
                r._populator.join(timeout=30)
        resident = [_rss_kib(r.path.name) for r in regions]
        if populate:
            assert all(kib >= (8 << 20) // 1024 * 0.95 for kib in resident), resident
        else:
            assert all(kib < 256 for kib in resident), resident  # untouched: sparse
            # First use faults in what it writes, and the pages read back.
            toks = list(range(4 * 16))
            pages = torch.rand((4, *layout.shape))
            store.put(toks, pages, Scope("ab" * 32))
            with store.acquire(toks, Scope("ab" * 32)) as lease:
                assert torch.equal(lease.pages(), pages)
        store.check_integrity()
    finally:
        store.close()
