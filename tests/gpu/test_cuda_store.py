"""GPU-only store tests: the device pool on CUDA, page-locked host memory, kvikio reads into
the device pool and compat-mode detection. Skipped cleanly without CUDA (CI is CPU-only);
run by scripts/device_check.sh on a machine with an NVIDIA GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import tierkv
from tierkv import PageLayout, Scope

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

# 16 layers x 2 x 16 tokens x 8 heads x 128 dims in fp16: 1 MiB pages, 4 KiB aligned.
LAYOUT = PageLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")
SCOPE = Scope("cd" * 32)


def _pages(n: int, seed: int = 0) -> torch.Tensor:
    g = np.random.default_rng(seed)
    raw = g.integers(0, 2**15, size=(n, LAYOUT.numel), dtype=np.int16)
    return torch.from_numpy(raw).view(torch.float16).reshape(n, *LAYOUT.shape)


def _open(home, **kw):
    opts = dict(device="cuda:0", device_bytes=64 * LAYOUT.page_bytes, host_bytes=64 * LAYOUT.slot_bytes,
                disk_bytes=256 * LAYOUT.slot_bytes, segment_pages=64)
    opts.update(kw)
    return tierkv.open(home, LAYOUT, **opts)


def test_device_pool_is_on_cuda_and_round_trips(tmp_path):
    tokens, pages = np.arange(32 * 16), _pages(32)
    with _open(tmp_path / "h") as store:
        assert store.device.pool.is_cuda
        assert store.put(tokens, pages.cuda(), SCOPE).durable
        with store.acquire(tokens, SCOPE) as lease:
            assert lease.pool.is_cuda and lease.num_blocks == 32
            assert torch.equal(lease.pages().cpu().view(torch.int16), pages.view(torch.int16))
        store.check_integrity()


def test_host_tier_is_page_locked(tmp_path):
    with _open(tmp_path / "h") as store:
        assert store.host.pinned, "cudaHostRegister of the shared host pool failed"
        assert store.stats()["tiers"]["host"]["kind"] == "pinned-shm"


def test_cold_reads_land_in_the_device_pool_verified(tmp_path):
    tokens, pages = np.arange(48 * 16), _pages(48, 1)
    with _open(tmp_path / "h") as store:
        store.put(tokens, pages, SCOPE)
    with _open(tmp_path / "h") as store:  # memory tiers empty: every page comes from disk
        path = store.stats()["disk_read_path"]
        assert path in ("kvikio-gds", "kvikio-compat", "posix-odirect", "posix-buffered")
        with store.acquire(tokens, SCOPE) as lease:
            assert lease.num_blocks == 48
            assert torch.equal(lease.pages().cpu().view(torch.int16), pages.view(torch.int16))
        assert store.stats()["quarantined"] == 0
        store.check_integrity()


def test_kvikio_is_used_when_importable_and_reports_compat_mode(tmp_path):
    kvikio = pytest.importorskip("kvikio")
    from tierkv.tiers.diskio import _kvikio_compat

    with _open(tmp_path / "h") as store:
        expected = "kvikio-compat" if _kvikio_compat(kvikio) else "kvikio-gds"
        assert store.disk.read_path == expected
        assert store.stats()["disk_read_path"] == expected


def test_a_corrupt_page_read_through_the_gpu_path_is_a_miss(tmp_path):
    tokens, pages = np.arange(8 * 16), _pages(8, 2)
    with _open(tmp_path / "h") as store:
        store.put(tokens, pages, SCOPE)
    seg = sorted((tmp_path / "h" / "segments").glob("seg-*.safetensors"))[0]
    from tierkv.tiers.segments import read_header

    off = read_header(seg).data_offset + 3 * LAYOUT.slot_bytes + 100
    with open(seg, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0xFF]))
    with _open(tmp_path / "h") as store:
        with store.acquire(tokens, SCOPE) as lease:
            assert lease.num_blocks == 3  # blocks 0-2 verified, block 3 quarantined
        assert store.stats()["quarantined"] == 1
        store.check_integrity()


BF16 = PageLayout(num_layers=16, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")


def test_bfloat16_pages_come_from_disk_in_few_requests(tmp_path):
    """kvikio takes buffers through __cuda_array_interface__, which has no bfloat16: the
    reads go as bytes. Adjacent device slots of one segment are one request, not one per page."""
    pytest.importorskip("kvikio")
    n = 64
    tokens = np.arange(n * 16)
    raw = torch.randint(-(2**15), 2**15, (n, BF16.numel), dtype=torch.int16, generator=torch.Generator().manual_seed(4))
    pages = raw.view(torch.bfloat16).view(n, *BF16.shape)
    opts = dict(device="cuda:0", device_bytes=(n + 8) * BF16.page_bytes, host_bytes=0,
                disk_bytes=2 * n * BF16.slot_bytes, segment_pages=256)
    with tierkv.open(tmp_path / "h", BF16, **opts) as store:
        assert store.put(tokens, pages.cuda(), SCOPE).durable
    with tierkv.open(tmp_path / "h", BF16, **opts) as store:
        requests = []
        files = store.disk.reads._cufiles
        real_get = files.get

        def counting_get(seg_id, path):
            f = real_get(seg_id, path)

            class Counted:
                def pread(self, buf, size, off):
                    requests.append(size)
                    return f.pread(buf, size, off)

            return Counted()

        files.get = counting_get
        with store.acquire(tokens, SCOPE) as lease:
            assert lease.num_blocks == n
            assert torch.equal(lease.pages().cpu().view(torch.int16), raw.view(n, *BF16.shape))
        assert sum(requests) == n * BF16.page_bytes and len(requests) < n // 2, requests
        assert store.stats()["quarantined"] == 0
        store.check_integrity()


def test_a_client_reads_the_daemons_cuda_pool_through_ipc(tmp_path):
    """A daemon in its own process (a CUDA IPC handle cannot be opened by the process that
    made it) shares its device pool; this process, the client, maps it on the GPU and reads
    a leased prefix from it with no copy through host memory."""
    import signal
    import subprocess
    import sys
    import time

    sock = tmp_path / "run" / "d.sock"
    budget = str(64 * LAYOUT.slot_bytes)
    proc = subprocess.Popen([sys.executable, "-c", "from tierkv.cli import main; main()", "serve",
                             "--home", str(tmp_path / "home"), "--socket", str(sock), "--device", "cuda:0",
                             "--device-bytes", budget, "--host-bytes", budget, "--disk-bytes", str(4 * int(budget)),
                             "--max-layouts", "1"])
    try:
        deadline = time.monotonic() + 120
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not start"
            time.sleep(0.1)
        tokens, pages = np.arange(16 * 16) + 3, _pages(16, 6)
        with tierkv.connect(sock, layout=LAYOUT) as c:
            assert c.device_pool.is_cuda
            assert c.put(tokens, pages.cuda(), SCOPE).durable
            with c.acquire(tokens, SCOPE) as lease:
                assert lease.num_blocks == 16 and lease.pool.is_cuda
                got = lease.pages()
                assert got.is_cuda and torch.equal(got.cpu().view(torch.int16), pages.view(torch.int16))
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_kv_is_copied_on_a_helper_thread_into_a_cache_made_in_inference_mode():
    """Lease.kv_into copies windows on a helper thread, where the caller's inference mode
    (per thread) is off, into a cache the caller made inside it: on a GPU this raised
    "Inplace update to inference tensor outside InferenceMode" (bench_ttft on an H200)."""
    import threading

    from tierkv.layout import _copy

    with torch.inference_mode():
        dst = torch.zeros(4, 8, device="cuda")
    src = torch.arange(32, dtype=torch.float32).view(4, 8)
    errors = []

    def run():
        try:
            _copy(dst, src)
        except Exception as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors, errors
    assert torch.equal(dst.cpu(), src)


def test_without_kvikio_cold_pages_reach_cuda_slots_through_a_bounded_staging(tmp_path, monkeypatch):
    """kvikio is an extra: without it, disk pages for CUDA slots are read in runs into the
    disk tier's staging buffer (STAGED_BYTES at a time), verified there and copied up."""
    from tierkv import promotion
    from tierkv.tiers import disk as disk_module

    monkeypatch.setattr(disk_module, "probe_kvikio", lambda: (None, ""))
    monkeypatch.setattr(promotion, "STAGED_BYTES", 8 * BF16.slot_bytes)
    n = 32
    tokens = np.arange(n * 16)
    raw = torch.randint(-(2**15), 2**15, (n, BF16.numel), dtype=torch.int16, generator=torch.Generator().manual_seed(8))
    opts = dict(device="cuda:0", device_bytes=(n + 8) * BF16.page_bytes, host_bytes=0,
                disk_bytes=2 * n * BF16.slot_bytes, segment_pages=256)
    with tierkv.open(tmp_path / "h", BF16, **opts) as store:
        assert store.put(tokens, raw.view(torch.bfloat16).view(n, *BF16.shape).cuda(), SCOPE).durable
    with tierkv.open(tmp_path / "h", BF16, **opts) as store:
        assert store.disk.read_path.startswith("posix")
        with store.acquire(tokens, SCOPE) as lease:
            assert lease.num_blocks == n
            assert torch.equal(lease.pages().cpu().view(torch.int16), raw.view(n, *BF16.shape))
        assert store.stats()["quarantined"] == 0
        store.check_integrity()


def test_a_cuda_page_written_to_the_pinned_host_tier_is_there_when_write_returns(tmp_path):
    """A copy from CUDA into the page-locked host pool is synchronous unless the caller asks
    (and then waits): the host slot is read by CPU code (a demotion to disk, a client's
    mapping) as soon as it is placed."""
    pages = _pages(16, 9).cuda()
    with _open(tmp_path / "h") as store:
        assert store.host.pinned
        for slot in range(16):
            store.host.write(slot, pages[slot])
            got = store.host.page(slot).view(torch.int16).numpy().copy()  # CPU read, no sync
            assert np.array_equal(got, pages[slot].view(torch.int16).cpu().numpy()), slot
