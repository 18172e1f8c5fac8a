"""Shared-memory regions are populated in the background, never at open and never by
writing: bytes written while the populator runs survive it."""
from __future__ import annotations

import time

import pytest
import torch

from tierkv.tiers.shm import SharedRegion

from helpers.residency import vma_fields


def _rss_kib(region: SharedRegion) -> int:
    """Resident KiB of this process's mapping of ``region`` (its file's own mapping: the
    kernel merges no neighbour into it)."""
    assert region.bytes is not None
    return vma_fields(region.bytes.data_ptr()).get("Rss", 0)


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
        rss = _rss_kib(region)
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

    real = shm.libc_madvise()
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

    monkeypatch.setattr(shm, "libc_madvise", lambda: counting)
    regions = [SharedRegion.create(tmp_path, f"tierkv-{name}", 24 << 20) for name in ("device", "host")]
    try:
        for r in regions:
            assert r._populator is not None
            r._populator.join(timeout=30)
            assert _rss_kib(r) >= (24 << 20) // 1024 * 0.95
        assert state["calls"] >= 2 * (24 << 20) // shm._POPULATE_CHUNK
        assert state["most"] == 1
    finally:
        for r in regions:
            r.close()


@pytest.mark.parametrize("populate", [False, True])
def test_a_store_populates_its_memory_tiers_only_when_asked_or_just_ahead_of_use(tmp_path, populate):
    """``populate_memory`` (the daemon sets it) faults the device and host tiers in behind
    the open. By default nothing is faulted in at open (an engine that opens its store and
    serves at once must not share its cores with a populator of its whole pool); once a tier
    is used, it is faulted in at most POPULATE_AHEAD_BYTES beyond its highest slot in use,
    on the region's helper thread, and the pages written read back."""
    import tierkv
    from tierkv import PageLayout, Scope
    from tierkv.tiers.memory import POPULATE_AHEAD_BYTES

    layout = PageLayout(num_layers=1, num_kv_heads=4, head_dim=128, block_size=16, dtype="float32")  # 64 KiB pages
    pool = 4 * POPULATE_AHEAD_BYTES
    store = tierkv.open(tmp_path / "home", layout, device="cpu", device_bytes=pool, host_bytes=8 << 20,
                        disk_bytes=0, shm_dir=tmp_path, populate_memory=populate)
    try:
        regions = [store.device.region, store.host.region]
        for r in regions:
            assert r is not None and (r._populator is not None) == populate
            if r._populator is not None:
                r._populator.join(timeout=30)
        resident = [_rss_kib(r) for r in regions]
        if populate:
            assert resident[0] >= pool // 1024 * 0.95, resident
            assert resident[1] >= (8 << 20) // 1024 * 0.95, resident
        else:
            assert all(kib < 256 for kib in resident), resident  # untouched at open: sparse
            toks = list(range(4 * 16))
            pages = torch.rand((4, *layout.shape))
            store.put(toks, pages, Scope("ab" * 32))
            device = store.device.region
            if device._populator is not None:
                device._populator.join(timeout=30)
            used = 4 * layout.page_bytes
            kib = _rss_kib(device)
            # Faulted in ahead of use (a madvise-less libc faults only what was written) ...
            if shm_madvise_available():
                assert kib >= (used + POPULATE_AHEAD_BYTES) // 1024 * 0.95, kib
            # ... and never the whole pool (4 MiB of slack: the kernel may map a little
            # around what it was asked to).
            assert kib <= (used + POPULATE_AHEAD_BYTES + (4 << 20)) // 1024, kib
            with store.acquire(toks, Scope("ab" * 32)) as lease:
                assert torch.equal(lease.pages(), pages)
        store.check_integrity()
    finally:
        store.close()


def shm_madvise_available() -> bool:
    from tierkv.tiers import shm

    return shm.libc_madvise() is not None


def test_raising_the_populate_end_never_waits_for_a_chunk_but_lowering_does(tmp_path, monkeypatch):
    """A tier's use growing raises its region's populate end on the put path (held: the
    store lock): that must not wait for the populator's chunk in flight. Lowering the end
    (a smaller budget, then a discard) must wait for it, so that nothing is faulted in
    beyond the new end afterwards."""
    import threading

    from tierkv.tiers import shm

    if shm.libc_madvise() is None:
        pytest.skip("no madvise in this libc: regions fault in on use, there is no populator")
    entered, release = threading.Event(), threading.Event()
    calls: list[tuple[int, int]] = []

    def blocking(addr, n, advice):
        calls.append((addr, n))
        entered.set()
        release.wait(30)
        return 0

    monkeypatch.setattr(shm, "libc_madvise", lambda: blocking)
    region = SharedRegion.create(tmp_path, "tierkv-device", 16 << 20, populate_bytes=4 << 20)
    try:
        assert entered.wait(10), "the populator did not start"
        t0 = time.perf_counter()
        region.set_populate_end(12 << 20)  # raised while a chunk is in flight
        assert time.perf_counter() - t0 < 1.0
        lowered = threading.Thread(target=region.set_populate_end, args=(2 << 20,))
        lowered.start()
        lowered.join(0.3)
        assert lowered.is_alive(), "lowering the end returned while a chunk was in flight"
        release.set()
        lowered.join(10)
        assert not lowered.is_alive()
        region._populator.join(10)
        start = region.bytes.data_ptr()
        assert all(addr - start + n <= 2 << 20 for addr, n in calls), calls  # nothing past the lowered end
    finally:
        release.set()
        region.close()


def test_populate_device_ahead_faults_in_only_the_device_tiers_first_64_mib(tmp_path):
    """``populate_device_ahead`` (the vLLM connector's embedded store sets it): the device
    tier's first POPULATE_AHEAD_BYTES are faulted in behind the open, the rest of it and the
    host tier stay sparse, and a first use within them asks for nothing more."""
    import tierkv
    from tierkv import PageLayout, Scope
    from tierkv.tiers.memory import POPULATE_AHEAD_BYTES

    layout = PageLayout(num_layers=1, num_kv_heads=4, head_dim=128, block_size=16, dtype="float32")  # 64 KiB pages
    pool = 4 * POPULATE_AHEAD_BYTES
    store = tierkv.open(tmp_path / "home", layout, device="cpu", device_bytes=pool, host_bytes=8 << 20,
                        disk_bytes=0, shm_dir=tmp_path, populate_device_ahead=True)
    try:
        device, host = store.device.region, store.host.region
        assert device._populator is not None and host._populator is None
        device._populator.join(timeout=30)
        slack = (4 << 20) // 1024  # the kernel may map a little around what it was asked to
        if shm_madvise_available():
            assert POPULATE_AHEAD_BYTES // 1024 * 0.95 <= _rss_kib(device) <= POPULATE_AHEAD_BYTES // 1024 + slack
        assert _rss_kib(host) < 256
        toks = list(range(4 * 16))
        pages = torch.rand((4, *layout.shape))
        store.put(toks, pages, Scope("ab" * 32))  # 256 KiB: well within what is faulted in
        assert device._populated_to <= POPULATE_AHEAD_BYTES  # nothing further was asked
        with store.acquire(toks, Scope("ab" * 32)) as lease:
            assert torch.equal(lease.pages(), pages)
        store.check_integrity()
    finally:
        store.close()


def test_the_vllm_connectors_embedded_store_faults_its_device_tier_in_ahead(tmp_path):
    from tierkv import PageLayout
    from tierkv.integrations.vllm.config import ConnectorConfig
    from tierkv.integrations.vllm.store import _close_shared, _open_shared

    layout = PageLayout(num_layers=1, num_kv_heads=4, head_dim=128, block_size=16, dtype="float32")
    cfg = ConnectorConfig(home=str(tmp_path / "home"), device_bytes=8 << 20, host_bytes=8 << 20, disk_bytes=64 << 20)
    store = _open_shared(cfg, layout)
    try:
        assert store.config.populate_device_ahead and store.device.region._populator is not None
    finally:
        _close_shared(store)
