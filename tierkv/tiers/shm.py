"""Shared-memory regions: files under /dev/shm mapped with mmap.

The host tier (and, without CUDA, the device tier) lives in such a region so that a second
process (a daemon's client) can map the same bytes. The file is 0600 to its creator; the
creator keeps it open (``fd``) and a daemon hands that descriptor to each client it admits
(SCM_RIGHTS over the socket), which maps it with :meth:`SharedRegion.attach_fd`. So a client
of another uid, admitted by the daemon's ``allowed_uids``, maps the tiers without any
permission on the file, and a client never opens a path the peer named (a fake listener
could name any file the client can write). The creator unlinks the file on close; a mapping
outlives the unlink, so clients that still hold it keep valid memory.
"""
from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import threading
from pathlib import Path

import torch

from .madvise import MADV_POPULATE_WRITE, MADV_REMOVE, advise, errno_now, libc_madvise

log = logging.getLogger(__name__)
# Small chunks: MADV_POPULATE_WRITE holds the process's mmap lock (for reading) through a
# chunk, and an allocation (mmap, which takes it for writing) waits for the chunk, and every
# page fault behind that waits too. With 32 MiB chunks and the thread at nice 19 on a busy
# 2-core VM, a restore right after open ran 2.4x slower than one 2 s later.
_POPULATE_CHUNK = 2 << 20
# One chunk at a time in the whole process: population is background work and should take
# at most one core. Each region has its own populator thread, and a store opens a device
# and a host region at once; on a 2-core machine both cores went to faulting pages in for
# the first second after open, under the first request's reads and copies.
_POPULATING = threading.Lock()


def default_shm_dir() -> Path:
    p = Path("/dev/shm")
    return p if p.is_dir() and os.access(p, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


class SharedRegion:
    """``nbytes`` of page-aligned memory backed by a file that other processes can map."""

    def __init__(self, path: Path, nbytes: int, mm: mmap.mmap, owner: bool, fd: int = -1) -> None:
        self.path = path
        self.nbytes = nbytes
        self._mmap = mm
        self.owner = owner
        self.fd = fd  # the creator's descriptor (handed to clients); -1 for an attached region
        self.pinned = False
        self._populate_stop = threading.Event()
        self._populator: threading.Thread | None = None
        # The populator faults pages in from _populated_to up to _populate_end, a chunk at a
        # time. Two locks, so that raising the end (a tier's use growing, on the put path)
        # never waits for a chunk: _populate_state guards the three fields and is held only
        # to read or set them; _populate_chunk is held through each chunk's madvise, and
        # only lowering the end and discard wait for it (nothing may be faulted in beyond
        # a lowered end, nor into a range being given back).
        self._populate_state = threading.Lock()
        self._populate_chunk = threading.Lock()
        self._populate_end = 0  # nothing asked yet (create sets it)
        self._populated_to = 0
        self._populating = False
        # torch.frombuffer keeps the mmap exported; we drop the tensor before closing.
        self.bytes: torch.Tensor | None = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, directory: Path, prefix: str, nbytes: int, populate_bytes: int | None = None) -> "SharedRegion":
        """A new region of ``nbytes``; its first ``populate_bytes`` (default: all) are faulted
        in on a helper thread. The rest stays sparse until written (a daemon layout's tier is
        mapped at the whole budget and used up to its share)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"{prefix}-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        region = cls(path, nbytes, mm, owner=True, fd=fd)
        region.set_populate_end(nbytes if populate_bytes is None else min(populate_bytes, nbytes))
        return region

    def _populate_in_background(self) -> None:
        """Fault the region's pages in on a helper thread, a chunk at a time, lowest first
        (held: ``_populate_state``, by the caller).

        First-touch faults on the data path cost about twice as much as faulting a range in
        one kernel call, so a pool is populated ahead of use; but not whole at open, where MAP_POPULATE
        made every store open pay ~0.7 s per GiB of tiers (an engine's first request paid it
        when the vLLM connector opened its store). MADV_POPULATE_WRITE (Linux 5.14) maps
        pages writable without touching their bytes, so it is safe beside concurrent
        writers, and ctypes drops the GIL around it. Older kernels fault on first touch."""
        if self.bytes is None or self.nbytes == 0 or self._populated_to >= self._populate_end:
            return
        if self._populating:
            return  # the running thread reads the new end before its next chunk
        addr, stop = self.bytes.data_ptr(), self._populate_stop
        self._populating = True

        def run() -> None:
            madvise = libc_madvise()
            while madvise is not None and not stop.is_set():
                with self._populate_chunk:
                    with self._populate_state:
                        off, end = self._populated_to, self._populate_end
                        if off >= end:
                            break
                        n = min(_POPULATE_CHUNK, end - off)
                    with _POPULATING:
                        refused = madvise(addr + off, n, MADV_POPULATE_WRITE) != 0
                    with self._populate_state:
                        if refused:
                            log.debug("MADV_POPULATE_WRITE refused (errno %d); pages fault in on use",
                                      errno_now())
                            self._populated_to = self._populate_end = self.nbytes  # never retried
                            break
                        self._populated_to = max(self._populated_to, min(off + n, self._populate_end))
            # Under the state lock: set_populate_end then either sees it running or starts one.
            with self._populate_state:
                self._populating = False

        self._populator = threading.Thread(target=run, name="tierkv-shm-populate", daemon=True)
        self._populator.start()

    def set_populate_end(self, end: int) -> None:
        """Fault pages in up to byte ``end`` (in the background). Raising the end returns at
        once; a lower end stops the populator there (returns after any chunk in flight, so
        nothing beyond ``end`` is faulted in by it afterwards)."""
        end = max(0, min(end, self.nbytes))
        with self._populate_state:
            lowered = end < self._populate_end
            self._populate_end = end
            self._populated_to = min(self._populated_to, end)
            self._populate_in_background()
        if lowered:
            with self._populate_chunk:
                pass  # the chunk in flight (read before the end moved) has finished

    def wait_populated(self, timeout: float | None = None) -> bool:
        """Wait until the background populator has faulted in everything asked of it
        (``set_populate_end``); False when ``timeout`` seconds passed first. For benchmarks
        of a warm pool (scripts/bench_store.py) and tests."""
        populator = self._populator
        if populator is not None:
            populator.join(timeout)
        with self._populate_state:
            return self._populated_to >= self._populate_end

    def discard(self, start: int, nbytes: int) -> bool:
        """Give the memory of bytes ``[start, start + nbytes)`` back to the system (they read
        as zeros afterwards; MADV_REMOVE punches a hole in the shared-memory file). Only for
        bytes nobody uses: a layout's tier slots above its limit. False when refused."""
        if self.bytes is None or nbytes <= 0:
            return False
        page = mmap.PAGESIZE
        lo, hi = -(-start // page) * page, (start + nbytes) // page * page  # whole pages only
        if hi <= lo:
            return False
        with self._populate_chunk:
            ok = advise(self.bytes.data_ptr() + lo, hi - lo, MADV_REMOVE)
        if not ok:
            log.debug("MADV_REMOVE refused (errno %d); the memory stays allocated", errno_now())
        return ok

    @classmethod
    def attach_fd(cls, fd: int, nbytes: int, name: str = "region") -> "SharedRegion":
        """Map a region from a descriptor received from its creator; closes ``fd``.
        Raises ValueError unless ``fd`` is a regular file of at least ``nbytes``."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError(f"shared region {name} is not a regular file")
            if st.st_size < nbytes:
                raise ValueError(f"shared region {name} holds {st.st_size} bytes, expected {nbytes}")
            mm = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return cls(Path(f"<fd:{name}>"), nbytes, mm, owner=False)

    def pin(self) -> bool:
        """Page-lock the region for fast, asynchronous host<->GPU copies (CUDA only)."""
        if not torch.cuda.is_available() or self.nbytes == 0 or self.bytes is None:
            return False
        rc = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.nbytes, 0)
        self.pinned = int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
        if not self.pinned:
            log.warning("cudaHostRegister failed (%s); host tier copies will be synchronous", rc)
        return self.pinned

    def close(self) -> None:
        if self.bytes is None:
            return
        self._populate_stop.set()
        if self._populator is not None:  # never unmap under a running madvise
            self._populator.join()
            self._populator = None
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        self.bytes = None
        try:
            self._mmap.close()
        except BufferError:
            # A tensor view still exports the buffer; the mapping is released with it.
            log.debug("shared region %s still referenced at close", self.path)
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self.owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


# A region file is unlinked by its creator at close; a process killed with SIGKILL cannot do
# that, and its tiers (often gigabytes of /dev/shm) would stay until reboot. Every store open
# removes region files whose creating pid (in the name) no longer exists. Only files of this
# user and of tierkv's naming pattern are touched; a file whose pid was reused by a live
# process is left alone (a leak, never a wrong delete of a live region).
REGION_RE = re.compile(r"^tierkv-(device|host|staging)-(\d+)-[0-9a-f]{8}$")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_stale_regions(directory: Path) -> int:
    """Delete region files in ``directory`` left by dead processes; returns how many."""
    removed = 0
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return 0
    for e in entries:
        match = REGION_RE.match(e.name)
        try:
            # Another process may remove the file between the listing and here (its owner
            # closing, or another store open reaping it): that is not an error.
            if not match or not e.is_file(follow_symlinks=False) or e.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
        except FileNotFoundError:
            continue
        pid = int(match.group(2))
        if pid == os.getpid() or pid_alive(pid):
            continue
        try:
            os.unlink(e.path)
            removed += 1
        except FileNotFoundError:
            pass
    if removed:
        log.info("removed %d shared-memory files of dead processes from %s", removed, directory)
    return removed
