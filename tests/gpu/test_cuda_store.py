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
