"""How page bytes move between disk segments and memory.

One interface, three paths, chosen once at open and reported in stats:
- ``kvikio-gds`` / ``kvikio-compat``: CUDA present and kvikio importable: ``CuFile.pread``
  straight into a device-pool slot (compat mode means kvikio bounces through host memory,
  which we log because it is slower than plain POSIX into pinned memory);
- ``posix-odirect`` (the default, where the file system accepts O_DIRECT): ``os.preadv`` on
  an O_DIRECT descriptor into a 4 KiB-aligned buffer (a device slot or a bounce buffer);
- ``posix-buffered`` (``StoreConfig.direct_reads=False``, or a file system that refuses
  O_DIRECT: tmpfs, some overlays): ``os.preadv`` through the page cache with the kernel's
  readahead, each run dropped from the cache once read (``POSIX_FADV_DONTNEED``) so that
  the memory tiers stay its only copy.
Writes are buffered ``pwrite`` followed by one ``fdatasync`` per segment per put.
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
from pathlib import Path

import torch

from .madvise import HUGE_PAGE, MADV_HUGEPAGE, MADV_POPULATE_WRITE, advise

log = logging.getLogger(__name__)


def probe_odirect(directory: Path) -> bool:
    """Whether this file system accepts O_DIRECT reads of 4 KiB at offset 0."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = directory / ".odirect-probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            buf = mmap.mmap(-1, 4096)
            os.preadv(fd, [buf], 0)
            buf.close()
        finally:
            os.close(fd)
        return True
    except OSError as e:
        log.info("O_DIRECT unavailable in %s (%s); using buffered reads", directory, e)
        return False
    finally:
        probe.unlink(missing_ok=True)


def probe_kvikio() -> tuple[object | None, str]:
    """(kvikio module or None, path name). kvikio needs a CUDA driver for any I/O."""
    if not torch.cuda.is_available():
        return None, ""
    try:
        import kvikio  # type: ignore[import-not-found]
        import kvikio.defaults  # type: ignore[import-not-found]
    except Exception as e:  # ImportError, or a missing libcufile raising OSError
        log.info("kvikio not importable (%s); disk reads go through POSIX", e)
        return None, ""
    compat = _kvikio_compat(kvikio)
    return kvikio, "kvikio-compat" if compat else "kvikio-gds"


def _kvikio_compat(kvikio: object) -> bool:
    defaults = getattr(kvikio, "defaults")
    for name in ("is_compat_mode_preferred", "compat_mode"):
        fn = getattr(defaults, name, None)
        if callable(fn):
            try:
                value = fn()
                # Newer kvikio returns a CompatMode enum: ON / OFF / AUTO.
                return bool(value) if isinstance(value, bool) else str(value).upper().endswith("ON")
            except Exception:
                continue
    return True


def drop_page_cache(paths: list[Path]) -> None:
    """Write back and evict ``paths`` from the page cache (POSIX_FADV_DONTNEED), so the next
    read comes from the device: what the benchmarks mean by a cold read."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class BounceBuffer:
    """A reusable page-aligned anonymous mapping for O_DIRECT transfers, faulted in at once
    unless ``populate=False`` (then by its first transfer, on the thread doing it).

    Backed by transparent huge pages where the system allows them (THP ``madvise`` or
    ``always``): the mapping is a whole number of 2 MiB (so the kernel places it on a 2 MiB
    boundary) and advised MADV_HUGEPAGE before anything touches it. Why: a disk transfer
    into 4 KiB pages scattered in physical memory is a scatter list of up to one segment per
    page, and a virtio disk takes at most a few hundred segments per request, so a 4 MiB
    read became several requests, each a round trip to the host. On the 2-vCPU VM of
    docs/performance.md a restore read through 4 KiB-page buffers ran at 0.67-0.77 of
    torch.load, through huge-page ones at 0.97-0.99 (three process pairs each)."""

    def __init__(self, nbytes: int, populate: bool = True) -> None:
        self.nbytes = nbytes
        size = -(-max(nbytes, 1) // HUGE_PAGE) * HUGE_PAGE
        self.mm = mmap.mmap(-1, size, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        if nbytes:
            addr = self.tensor.data_ptr()
            advise(addr, size, MADV_HUGEPAGE)  # before the first touch, or the pages are small
            if populate and not advise(addr, size, MADV_POPULATE_WRITE):
                self.tensor.zero_()  # a kernel before 5.14: faulted in by touch

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        try:
            self.mm.close()
        except BufferError:
            pass


def pwrite_all(fd: int, data: memoryview | list[memoryview], off: int) -> None:
    """One write of ``data`` (a buffer, or consecutive buffers in one ``pwritev``) at ``off``;
    a short write is an EIO."""
    bufs = data if isinstance(data, list) else [data]
    n, want = os.pwritev(fd, bufs, off), sum(len(b) for b in bufs)
    if n != want:
        raise OSError(errno.EIO, f"short write {n} of {want}")


def pread_full(fd: int, buf: memoryview | mmap.mmap, offset: int) -> None:
    """Read exactly len(buf) bytes at ``offset``; a short read is an EIO (torn segment)."""
    n = os.preadv(fd, [buf], offset)
    if n != len(buf):
        raise OSError(errno.EIO, f"short read: {n} of {len(buf)} bytes at offset {offset}")


class KvikioFiles:
    """The disk tier's open kvikio handles, one per segment (opening a ``CuFile`` registers
    the file with cuFile: too slow to pay per page), closed when the segment is dropped or
    the tier closes."""

    def __init__(self, kvikio: object | None) -> None:
        self._kvikio = kvikio
        self._files: dict[int, object] = {}
        self._lock = threading.Lock()

    def get(self, seg_id: int, path: Path) -> object:
        with self._lock:
            f = self._files.get(seg_id)
            if f is None:
                f = self._files[seg_id] = self._kvikio.CuFile(str(path), "r")  # type: ignore[attr-defined]
            return f

    def drop(self, seg_id: int) -> None:
        with self._lock:
            f = self._files.pop(seg_id, None)
        if f is not None:
            f.close()  # type: ignore[attr-defined]

    def close(self) -> None:
        with self._lock:
            files, self._files = list(self._files.values()), {}
        for f in files:
            f.close()  # type: ignore[attr-defined]


def cuda_bytes(first: torch.Tensor, nbytes: int) -> torch.Tensor:
    """``nbytes`` of CUDA memory from ``first``'s first byte on, as one uint8 tensor (kvikio
    takes buffers through ``__cuda_array_interface__``, which has no bfloat16)."""
    span = torch.empty(0, dtype=torch.uint8, device=first.device)
    return span.set_(first.untyped_storage(), first.storage_offset() * first.element_size(), (nbytes,), (1,))
