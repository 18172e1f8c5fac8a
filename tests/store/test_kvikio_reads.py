"""The disk tier's kvikio read path (DiskReads.read_many_to_device) against a stand-in for
kvikio that reads with os.pread: request coalescing, destinations that are not adjacent,
short and failed reads. kvikio itself needs a CUDA driver for any I/O, so this is the
supplement; tests/gpu/test_cuda_store.py reads through the real one on a GPU."""
from __future__ import annotations

import errno
import os

import pytest
import torch

from tierkv.tiers import TierName
from tierkv.tiers.diskio import KvikioFiles

from .kit import LAYOUT_4K, keys_of, open_store, pages_for, put_chain, toks

DISK = TierName.DISK


class FakeKvikio:
    """kvikio's CuFile/IOFuture surface over os.pread into (CPU) tensors, recording calls."""

    def __init__(self, short_at: int | None = None, fail_at: int | None = None) -> None:
        self.reads: list[tuple[str, int, int]] = []
        self.opened: list[str] = []
        self.closed = 0
        self.gets = 0
        self.short_at, self.fail_at = short_at, fail_at
        fake = self

        class Future:
            def __init__(self, n: int, fail: bool) -> None:
                self.n, self.fail = n, fail

            def get(self) -> int:
                fake.gets += 1
                if self.fail:
                    raise RuntimeError("cuFile error: EIO")
                return self.n

        class CuFile:
            def __init__(self, path: str, mode: str) -> None:
                assert mode == "r"
                fake.opened.append(path)
                self.fd = os.open(path, os.O_RDONLY)

            def pread(self, buf: torch.Tensor, size: int, file_offset: int) -> Future:
                assert buf.dtype == torch.uint8 and buf.numel() == size
                k = len(fake.reads)
                fake.reads.append((os.readlink(f"/proc/self/fd/{self.fd}"), size, file_offset))
                data = os.pread(self.fd, size, file_offset)
                buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                n = size - 4096 if k == fake.short_at else len(data)
                return Future(n, k == fake.fail_at)

            def close(self) -> None:
                fake.closed += 1
                os.close(self.fd)

        self.CuFile = CuFile


@pytest.fixture
def cold_store(tmp_path):
    """A store whose 24 blocks (4 KiB pages, 16 per segment) are on disk only."""
    opts = dict(layout=LAYOUT_4K, shm_dir=tmp_path / "shm", device_bytes=64 * LAYOUT_4K.page_bytes, host_bytes=0,
                disk_bytes=64 * LAYOUT_4K.slot_bytes, segment_pages=16)
    chain = toks(7, 24)
    with open_store(tmp_path / "h", **opts) as store:
        assert put_chain(store, chain).durable
    store = open_store(tmp_path / "h", **opts)
    yield store, chain
    store.close()


def _with_fake(store, chain, fake: FakeKvikio) -> list[int]:
    """Put ``fake`` in kvikio's place in the store's disk tier; the chain's disk locations."""
    store.disk.reads._kvikio = fake
    store.disk.reads._cufiles = KvikioFiles(fake)
    blocks = store.placement.table.blocks
    return [blocks[k].loc[DISK] for k in keys_of(chain)]


def _expected(chain) -> torch.Tensor:
    return pages_for(chain, layout=LAYOUT_4K).view(torch.uint8).reshape(len(chain) // 4, -1)


def test_adjacent_pages_of_one_segment_are_one_request_and_exact(cold_store):
    store, chain = cold_store
    fake = FakeKvikio()
    locs = _with_fake(store, chain, fake)
    dest = torch.zeros(24, *LAYOUT_4K.shape, dtype=LAYOUT_4K.torch_dtype)
    seen: list[int] = []
    store.disk.read_many_to_device([(loc, dest[i]) for i, loc in enumerate(locs)], seen.extend)
    assert torch.equal(dest.view(torch.uint8).reshape(24, -1), _expected(chain))
    assert sorted(seen) == list(range(24))
    assert len(fake.reads) == 2 and sorted(r[1] for r in fake.reads) == [8 * 4096, 16 * 4096]  # one per segment
    assert len(set(fake.opened)) == len(fake.opened) == 2  # each segment's handle opened once ...
    store.disk.read_many_to_device([(locs[0], dest[0])])
    assert len(fake.opened) == 2  # ... and kept
    store.close()
    assert fake.closed == 2  # closed with the tier


def test_pages_that_are_not_adjacent_in_memory_are_read_one_by_one(cold_store):
    store, chain = cold_store
    fake = FakeKvikio()
    locs = _with_fake(store, chain, fake)
    dest = torch.zeros(24, *LAYOUT_4K.shape, dtype=LAYOUT_4K.torch_dtype)
    store.disk.read_many_to_device([(loc, dest[23 - i]) for i, loc in enumerate(locs)])
    assert torch.equal(dest.flip(0).view(torch.uint8).reshape(24, -1), _expected(chain))
    assert len(fake.reads) == 24


@pytest.mark.parametrize("fault", ["short", "failed"])
def test_a_bad_request_is_an_eio_raised_after_every_request_ended(cold_store, fault):
    store, chain = cold_store
    fake = FakeKvikio(short_at=0 if fault == "short" else None, fail_at=0 if fault == "failed" else None)
    locs = _with_fake(store, chain, fake)
    dest = torch.zeros(24, *LAYOUT_4K.shape, dtype=LAYOUT_4K.torch_dtype)
    seen: list[int] = []
    with pytest.raises(OSError) as e:
        store.disk.read_many_to_device([(loc, dest[i]) for i, loc in enumerate(locs)], seen.extend)
    assert e.value.errno == errno.EIO
    assert fake.gets == len(fake.reads) == 2  # the other request was waited for
    assert seen == []  # nothing is handed on for verification once a request failed
