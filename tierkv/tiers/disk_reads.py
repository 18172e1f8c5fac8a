"""The disk tier's read path (kvikio into CUDA pages, buffered ``preadv`` with each run
dropped from the page cache once read, or O_DIRECT into aligned buffers) and its read
health: a read I/O error is a miss, never a deletion."""
from __future__ import annotations

import errno
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch

from .diskio import BounceBuffer, KvikioFiles, cuda_bytes, pread_full, probe_kvikio
from .disk_files import SegmentFiles

log = logging.getLogger("tierkv.tiers.disk")  # one logger for the whole disk tier
READ_DEPTH = 2  # runs of one read_many in flight at once (scripts/bench_store.py)
# The largest read request (as the writes'). A smaller batch, such as a restore window, is
# cut in READ_DEPTH runs, so that it is READ_DEPTH requests in flight, not one
# (docs/performance.md, the restore).
READ_RUN_BYTES = 8 << 20


class DiskReads:
    """Reads of whole slots and pages from ``files``. Owns what reading needs: the read
    descriptors and kvikio handles (one per segment, closed by :meth:`forget` when the
    segment goes), the reader threads, each thread's aligned buffer, and the read health.
    ``direct_reads``: O_DIRECT reads (the caller has checked the file system takes them)."""

    def __init__(self, files: SegmentFiles, *, direct_reads: bool) -> None:
        self.files = files
        self.layout, self.codec = files.layout, files.codec
        # Pages are stored in the codec's form: these sizes are the stored ones.
        self.page_bytes, self.slot_bytes = self.codec.stored_bytes, self.codec.slot_bytes
        self.direct_reads = direct_reads
        self._fd_lock = threading.Lock()  # guards _read_fds and _reader_pool
        self._read_fds: dict[int, int] = {}
        self._reader_pool: ThreadPoolExecutor | None = None
        self._local = threading.local()  # each thread's bounce buffer
        self._kvikio, kv_path = probe_kvikio()
        self._cufiles = KvikioFiles(self._kvikio)
        self.read_path = kv_path or ("posix-odirect" if direct_reads else "posix-buffered")
        self.read_degraded_reason: str | None = None
        self.read_errors = 0

    def note_read_error(self, err: BaseException) -> None:
        """A read failed with an I/O error (not a bad page). The tier is *read-degraded*
        (stats, logs) until a read succeeds again. Reads are not skipped meanwhile: every
        later read is the retry (a failed device answers at once), and the first one that
        succeeds clears the state. The blocks stay indexed and are served again then."""
        self.read_errors += 1
        reason = errno.errorcode.get(getattr(err, "errno", None) or 0, str(err))
        if self.read_degraded_reason is None:
            log.error("disk tier read-degraded: %s (blocks stay indexed; their reads miss until the device answers)", err)
        self.read_degraded_reason = reason

    def note_read_ok(self) -> None:
        if self.read_degraded_reason is not None:
            log.warning("disk tier reads work again (was: %s)", self.read_degraded_reason)
            self.read_degraded_reason = None

    def _readers(self) -> ThreadPoolExecutor:
        """The tier's reader threads (READ_DEPTH), made on first use."""
        with self._fd_lock:
            if self._reader_pool is None:
                self._reader_pool = ThreadPoolExecutor(READ_DEPTH, thread_name_prefix="tierkv-read")
            return self._reader_pool

    def _bounce(self, nbytes: int = 0) -> BounceBuffer:
        """This thread's aligned staging buffer, grown to at least ``nbytes``."""
        bounce = getattr(self._local, "bounce", None)
        want = max(nbytes, self.slot_bytes)
        if bounce is None or bounce.nbytes < want:
            if bounce is not None:
                bounce.close()
            bounce = self._local.bounce = BounceBuffer(want)
        return bounce

    def forget(self, seg_id: int) -> None:
        """Close what reads hold of segment ``seg_id`` (its file is about to go)."""
        with self._fd_lock:
            fd = self._read_fds.pop(seg_id, None)
            if fd is not None:
                os.close(fd)
        self._cufiles.drop(seg_id)

    def close(self) -> None:
        if self._reader_pool is not None:
            self._reader_pool.shutdown(wait=True)
            self._reader_pool = None
        with self._fd_lock:
            for fd in self._read_fds.values():
                os.close(fd)
            self._read_fds.clear()
        self._cufiles.close()

    def _read_fd(self, seg_id: int, path: Path) -> int:
        with self._fd_lock:
            fd = self._read_fds.get(seg_id)
            if fd is None:
                flags = os.O_RDONLY | (os.O_DIRECT if self.direct_reads else 0)
                fd = os.open(path, flags)
                self._read_fds[seg_id] = fd
            return fd

    def read_into(self, loc: int, buf: memoryview) -> None:
        """Read ``len(buf)`` bytes of the slot at ``loc`` into ``buf``; with O_DIRECT the
        buffer's address and length must be 4 KiB multiples (a full slot, or a whole page
        whose size is a 4 KiB multiple)."""
        seg, seg_id, off = self.files.offset(loc)
        fd = self._read_fd(seg_id, seg.path)
        pread_full(fd, buf, off)
        self._uncache(fd, off, len(buf))

    def _uncache(self, fd: int, off: int, nbytes: int) -> None:
        """After a buffered read: drop the bytes from the page cache. The memory tiers hold
        the page now, and a second copy in the cache would be memory the tiers' budgets do
        not count (only clean cached pages go: nothing unwritten is lost, and on tmpfs,
        where the cache is the file, nothing is dropped)."""
        if not self.direct_reads:
            os.posix_fadvise(fd, off, nbytes, os.POSIX_FADV_DONTNEED)

    def read_many(self, items: list[tuple[int, memoryview]],
                  on_run: Callable[[list[int]], None] | None = None) -> None:
        """Read whole slots into buffers of ``slot_bytes`` each (aligned, for O_DIRECT):
        consecutive slots in one ``preadv`` with one buffer per slot, up to READ_DEPTH runs
        in flight. ``on_run`` is called (on the thread that read it) with the positions (in
        ``items``) of each run as soon as it has been read, so the caller can verify it
        while other runs are read. Raises the first OSError after every read in flight has
        ended (so no buffer is written once this returns or raises)."""
        locs = [loc for loc, _ in items]
        # Runs of at most READ_RUN_BYTES; a smaller batch in READ_DEPTH runs of equal size.
        even = -(-len(locs) // READ_DEPTH) * self.slot_bytes
        runs = self.files.runs(locs, min(READ_RUN_BYTES, even))

        def read_run(run: list[int]) -> None:
            seg, seg_id, off = self.files.offset(locs[run[0]])
            bufs = [items[k][1] for k in run]
            want = sum(len(b) for b in bufs)
            fd = self._read_fd(seg_id, seg.path)
            n = os.preadv(fd, bufs, off)
            if n != want:
                raise OSError(errno.EIO, f"short read: {n} of {want} bytes at offset {off}")
            self._uncache(fd, off, want)
            if on_run is not None:
                on_run(run)

        if len(runs) < 2:
            for run in runs:
                read_run(run)
            return
        # Two runs in flight: a virtio or NVMe device keeps busy across one request's
        # completion and the next one's submission, and the kernel's faulting-in of fresh
        # destination pages for one run overlaps the other's transfer (preadv drops the GIL).
        futures = [self._readers().submit(read_run, run) for run in runs]
        error: BaseException | None = None
        for f in futures:
            if error is not None:
                f.cancel()
            try:
                if not f.cancelled():
                    f.result()
            except BaseException as e:  # noqa: BLE001 - the first is raised once all have ended
                error = error or e
        if error is not None:
            raise error

    def staging(self, n: int) -> tuple[torch.Tensor, list[memoryview]]:
        """This thread's aligned staging buffer for ``n`` whole slots: as ``[n, slot_bytes]``
        uint8 and as one writable view per slot (for :meth:`read_many`). Valid until this
        thread's next read through the tier. With a codec, pages are read here, verified,
        then decoded into the device tier (they cannot land in a device slot as they are)."""
        bounce = self._bounce(n * self.slot_bytes)
        mm = memoryview(bounce.mm)
        views = [mm[p * self.slot_bytes : (p + 1) * self.slot_bytes] for p in range(n)]
        return bounce.tensor[: n * self.slot_bytes].view(n, self.slot_bytes), views

    def read_page(self, loc: int) -> torch.Tensor:
        """The page at ``loc`` as a new CPU tensor, as stored: in the layout's shape and dtype
        (codec ``none``), else the codec's stored form (``[stored_bytes]`` uint8, which the
        checksum covers; the device tier decodes it when written)."""
        bounce = self._bounce()
        self.read_into(loc, memoryview(bounce.mm)[: self.slot_bytes])
        page_u8 = torch.from_numpy(bounce.tensor[: self.page_bytes].numpy().copy())
        if not self.codec.exact:
            return page_u8
        return page_u8.view(self.layout.torch_dtype).view(self.layout.shape)

    @property
    def reads_to_device(self) -> bool:
        # Not with a codec: a stored page is decoded on its way into the device tier.
        return self._kvikio is not None and self.codec.exact

    def read_many_to_device(self, items: list[tuple[int, torch.Tensor]],
                            on_run: Callable[[list[int]], None] | None = None) -> None:
        """kvikio path: pages straight into contiguous CUDA pages (``items``: location, page).
        Consecutive slots of one segment whose pages are adjacent in device memory go in one
        request of up to READ_RUN_BYTES (when a slot is exactly a page); every request is in
        flight at once (kvikio splits each over its thread pool; GPUDirect Storage, or its
        compat mode's bounce buffers). ``on_run`` as :meth:`read_many`'s, called on this
        thread as each request completes, in order. Raises the first OSError (a short read
        too) after every request in flight has ended."""
        assert self._kvikio is not None
        locs = [loc for loc, _ in items]
        page = self.page_bytes
        runs = self.files.runs(locs, READ_RUN_BYTES) if self.slot_bytes == page else [[k] for k in range(len(items))]
        parts: list[list[int]] = []
        for run in runs:  # a run (consecutive slots) split where its pages are not adjacent
            start = len(parts)
            for k in run:
                dest = items[k][1]
                assert dest.is_contiguous() and dest.nbytes == page
                if len(parts) > start and dest.data_ptr() == items[parts[-1][-1]][1].data_ptr() + page:
                    parts[-1].append(k)
                else:
                    parts.append([k])
        pending = []
        error: BaseException | None = None
        try:
            for part in parts:
                seg, seg_id, off = self.files.offset(locs[part[0]])
                f = self._cufiles.get(seg_id, seg.path)
                want = len(part) * page
                pending.append((part, want, f.pread(cuda_bytes(items[part[0]][1], want), want, off)))  # type: ignore[attr-defined]
        except Exception as e:  # noqa: BLE001 - raised once the requests already made have ended
            error = _as_os_error(e)
        for part, want, future in pending:
            try:
                n = future.get()
                if n != want:
                    raise OSError(errno.EIO, f"short kvikio read: {n} of {want} bytes")
            except Exception as e:  # noqa: BLE001 - the first is raised once all have ended
                error = error or _as_os_error(e)
                continue
            if on_run is not None and error is None:
                on_run(part)
        if error is not None:
            raise error


def _as_os_error(e: Exception) -> OSError:
    """kvikio reports a failed read as a RuntimeError: an I/O error to the store (a miss,
    the tier read-degraded), as a failed ``preadv`` is."""
    if isinstance(e, OSError):
        return e
    err = OSError(errno.EIO, f"kvikio read failed: {e}")
    err.__cause__ = e
    return err
