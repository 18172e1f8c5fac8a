"""Real file-system faults for tests (root only): no mocks, the kernel returns the errors.

- :func:`loop_ext4` mounts a fresh ext4 image through a loop device. ``fail()`` shrinks the
  loop device to 4 KiB under the mounted file system (LOOP_SET_STATUS64 with a new
  ``lo_sizelimit``), so every read or write that reaches the device gets EIO ("attempt to
  access beyond end of device"); ``heal()`` restores the size and the same open files work
  again. This is how a transient device fault looks to the store (reads must bypass the page
  cache to see it: O_DIRECT, or :func:`drop_cache`). Built without a journal by default, so
  that failed metadata writes do not abort the file system for good (``errors=continue``).
- ``force_read_only()`` makes ext4 itself declare an error (``/sys/fs/ext4/DEV/trigger_fs_error``)
  on a file system mounted ``errors=remount-ro``: from then on every write, even through
  files already open for writing (as LMDB's are), fails with EROFS, while reads work.
  ``remount()`` (unmount, mount again) clears it; it needs every file on it closed.
- :func:`tmpfs` mounts a small tmpfs (ENOSPC once ``size`` bytes are used).

Rejected: device-mapper ``error``/``flakey`` targets (no dm driver in the test kernel) and
``mount -o remount,ro`` (refused with EBUSY while any file is open for writing).

Every helper unmounts and detaches what it made, also when the test fails. Use
:func:`fault_skip_reason` to skip (with the reason) only when not root or when the kernel or
the tools lack loop devices; a tierkv failure is never a skip.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Iterator

_LOOP_INFO64 = struct.Struct("<QQQQQIIII64s64s32sQQ")  # struct loop_info64 (linux/loop.h)
_LOOP_SET_STATUS64, _LOOP_GET_STATUS64 = 0x4C04, 0x4C05
_SIZELIMIT = 4  # field index of lo_sizelimit


def fault_skip_reason() -> str | None:
    """Why real-fault tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "real fault injection needs root (loop devices, mounts)"
    if not os.path.exists("/dev/loop-control"):
        return "the kernel has no loop devices (/dev/loop-control missing)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (scripts/test.sh installs e2fsprogs and mount as root)"
    return None


def _run(*cmd: str) -> str:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def _umount(path: Path) -> None:
    """Unmount ``path``; lazily if something still has files open there (the test failed
    while a store held them), so the test never leaves a mount behind."""
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def drop_cache(path: Path) -> None:
    """Evict every file under ``path`` from the page cache, so the next read goes to the device."""
    for p in path.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


class LoopExt4:
    """An ext4 file system on a loop device, mounted at ``path``. See the module docstring."""

    def __init__(self, image: Path, path: Path, size_mib: int = 64, journal: bool = False,
                 errors: str = "continue") -> None:
        self.image, self.path, self.errors = image, path, errors
        with open(image, "wb") as f:
            f.truncate(size_mib << 20)
        features = [] if journal else ["-O", "^has_journal"]
        _run("mkfs.ext4", "-q", "-F", "-b", "4096", *features, str(image))
        self.dev = _run("losetup", "--find", "--show", str(image))
        path.mkdir(parents=True, exist_ok=True)
        try:
            self._mount()
        except BaseException:
            _run("losetup", "-d", self.dev)
            raise
        self._failed = False

    def _mount(self) -> None:
        _run("mount", "-t", "ext4", "-o", f"errors={self.errors}", self.dev, str(self.path))

    def _sizelimit(self, limit: int) -> None:
        fd = os.open(self.dev, os.O_RDONLY)
        try:
            buf = bytearray(_LOOP_INFO64.size)
            fcntl.ioctl(fd, _LOOP_GET_STATUS64, buf)
            fields = list(_LOOP_INFO64.unpack(buf))
            fields[_SIZELIMIT] = limit
            fcntl.ioctl(fd, _LOOP_SET_STATUS64, _LOOP_INFO64.pack(*fields))
        finally:
            os.close(fd)

    def fail(self) -> None:
        """From now on every I/O that reaches the device fails with EIO.

        Dirty pages are written first: writeback of delayed-allocation pages to a failed
        device can spin in the kernel (seen on 6.18: an O_DIRECT read flushing them waited
        in reclaim_throttle until the device came back). So while failed, write only with
        O_DIRECT (as the disk tier does) or expect the writer to block until ``heal()``."""
        os.sync()
        self._sizelimit(4096)
        self._failed = True

    def heal(self) -> None:
        """The device answers again (same data: the image was never touched)."""
        self._sizelimit(0)  # 0 = the whole backing file
        self._failed = False

    def force_read_only(self) -> None:
        """ext4 declares an error; mounted ``errors=remount-ro`` it refuses every write (EROFS)."""
        assert self.errors == "remount-ro", "mount with errors='remount-ro' to force it read-only"
        name = os.path.basename(self.dev)
        Path(f"/sys/fs/ext4/{name}/trigger_fs_error").write_text("tierkv test: forced read-only\n")

    def remount(self) -> None:
        """Unmount and mount again (clears a forced read-only state). Close every file first."""
        _run("umount", str(self.path))
        self._mount()

    def close(self) -> None:
        if self._failed:
            self.heal()
        _umount(self.path)
        subprocess.run(["losetup", "-d", self.dev], capture_output=True)
        self.image.unlink(missing_ok=True)


@contextlib.contextmanager
def loop_ext4(image: Path, path: Path, size_mib: int = 64, journal: bool = False,
              errors: str = "continue") -> Iterator[LoopExt4]:
    """A mounted :class:`LoopExt4`, unmounted and detached afterwards."""
    fs = LoopExt4(image, path, size_mib, journal, errors)
    try:
        yield fs
    finally:
        fs.close()


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` (rounded up to pages) mounted at ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    _run("mount", "-t", "tmpfs", "-o", f"size={size_bytes},mode=0700", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)
